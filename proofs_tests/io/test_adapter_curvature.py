"""Adapters first-class: a LoRA adapter's curvature over what it changes, untouched tensors copied.

References: the curvature of the whole materialised model (``--whole-model``), restricted to the
adapter's parameters; Eq. 6 computed in memory (``gm.gradient_matching``) over whole state dicts
with whole-model curvatures, where a tensor no model changes comes out as the base bit for bit
(its right-hand side is zero and H̄ does not couple it to the rest); RegMean's refusal of a
singular Gram where no model changed anything, which the copy avoids.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file

import gradmerge as gm
from gradmerge import cli
from gradmerge.curvature.io import open_curvature
from gradmerge.errors import StructureError
from gradmerge.io.lora import adapted_parameters, changed_tensors
from gradmerge.jobs import MergeConfig, run_merge
from proofs_tests.text_models import bert_classifier, lora_adapter

peft = pytest.importorskip("peft")

TEXTS = [
    ("the movie was very good", "positive"),
    ("a dull film", "negative"),
    ("the cat sat on the mat", "neutral"),
]


def _adapter(base, folder, seed, **options):
    """A LoRA adapter of the model in ``base`` with random (non-zero) B, saved to ``folder``, and
    peft's merge_and_unload of it saved to ``folder``-full."""
    model = transformers.BertForSequenceClassification.from_pretrained(base)
    wrapped = lora_adapter(model, folder, seed, base=base, **options)
    full = folder.parent / f"{folder.name}-full"
    wrapped.merge_and_unload().save_pretrained(full)
    return folder, full


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters (query/value, rank 2 and 3, a saved classification head) of a float64 BERT."""
    root = tmp_path_factory.mktemp("adapters")
    base = bert_classifier(root / "base")
    made = [
        _adapter(
            base,
            root / f"ad{t}",
            20 + t,
            task_type="SEQ_CLS",
            r=2 + t,
            lora_alpha=4,
            target_modules=["query", "value"],
        )
        for t in range(2)
    ]
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in TEXTS))
    return root, base, made, data


def _curvature(adapter, data, out, structure, *extra):
    argv = ["curvature", str(adapter), str(data), str(out), "--structure", structure]
    assert cli.main([*argv, "--no-progress", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def curvatures(adapters):
    """(restricted, whole-model) curvature files of each adapter, per structure."""
    root, _, made, data = adapters
    out = {}
    for structure in ("diag", "kfac"):
        for t, (adapter, _) in enumerate(made):
            out[structure, t] = (
                _curvature(adapter, data, root / f"r{structure}{t}.safetensors", structure),
                _curvature(
                    adapter, data, root / f"w{structure}{t}.safetensors", structure, "--whole-model"
                ),
            )
    return out


def test_adapted_parameters_are_the_targets_and_saved_modules(adapters):
    _, base, made, _ = adapters
    names = [
        n
        for n, _ in transformers.BertForSequenceClassification.from_pretrained(
            base
        ).named_parameters()
    ]
    chosen = adapted_parameters(made[0][0], names)
    expected = {
        n
        for n in names
        if re.search(r"\.(query|value)\.(weight|bias)$", n) or n.startswith("classifier.")
    }
    assert set(chosen) == expected
    assert changed_tensors(made[0][0]) == {
        n for n in expected if n.endswith("weight") or n.startswith("classifier.")
    }


@pytest.mark.parametrize("structure", ["diag", "kfac"])
def test_restricted_estimate_equals_the_whole_model_estimate_there(curvatures, structure):
    restricted, whole = curvatures[structure, 0]
    with open_curvature(restricted) as r, open_curvature(whole) as w:
        keys = [k for k, _ in r.layout]
        assert r.info["restricted"] == "adapter" and "restricted" not in w.info
        assert set(keys) < {k for k, _ in w.layout}
        part, own = w.restrict(keys), r.load()
        assert own.layout == part.layout
        if structure == "kfac":  # an adapted Linear's factors are the same: A and G, and M
            kfac = (
                [b for b in own.blocks if isinstance(b, gm.KFAC)]
                if isinstance(own, gm.Blocks)
                else [own]
            )
            assert kfac and set(kfac[0].terms) >= {n.rpartition(".")[0] for n in keys}
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            v = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in own.layout}
            a, b = own.mv(v), part.mv(v)
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-15, msg=k)


def _merge(root, name, config):
    (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    out = root / name
    assert cli.main(["merge", str(root / f"{name}.yaml"), str(out), "--no-progress"]) == 0
    return load_file(str(out / "model.safetensors")), json.loads(
        (out / "gradmerge_merge.json").read_text()
    )


@pytest.mark.parametrize("structure", ["diag", "kfac"])
def test_merge_of_restricted_curvatures_is_eq6_of_whole_model_ones(
    adapters, curvatures, structure, tmp_path
):
    """The streamed merge of the adapters with their restricted curvatures equals Eq. 6 computed
    in memory over the whole materialised models with whole-model curvatures: to round-off on
    the adapted tensors, and the base bit for bit on every other (where Eq. 6's right-hand side
    is zero: no curvature is needed there, and none changes it)."""
    _, base, made, _ = adapters
    delta = 0.5
    config = {
        "method": "gradient_matching",
        "base_model": str(base),
        "models": [
            {"model": str(ad), "curvature": str(curvatures[structure, t][0]), "alpha": 0.7}
            for t, (ad, _) in enumerate(made)
        ],
        "prior": {"delta": delta},
        "compute_dtype": "float64",
    }
    merged, record = _merge(tmp_path, "restricted", config)

    theta0 = load_file(str(base / "model.safetensors"))
    whole = [gm.load_curvature(curvatures[structure, t][1]) for t in range(2)]
    keys = [k for k, _ in whole[0].layout]
    fulls = [load_file(str(full / "model.safetensors")) for _, full in made]
    reference = gm.gradient_matching(
        {k: theta0[k] for k in keys},
        [{k: f[k] for k in keys} for f in fulls],
        whole,
        prior=delta,
        alphas=0.7,
    )
    changed = changed_tensors(made[0][0]) | changed_tensors(made[1][0])
    with open_curvature(curvatures[structure, 0][0]) as f:
        adapted = {k for k, _ in f.layout}  # K-FAC: an adapted layer's bias is coupled to W
    merged_keys = changed | (adapted if structure == "kfac" else set())
    for k in keys:
        if k in merged_keys:
            torch.testing.assert_close(merged[k], reference[k], rtol=1e-10, atol=1e-13, msg=k)
            assert not torch.equal(merged[k], theta0[k]) or k not in changed
        else:  # Eq. 6 itself gives the base there, bit for bit; so does the copy
            assert torch.equal(reference[k], theta0[k]), k
            assert torch.equal(merged[k], theta0[k]), k
    untouched = record["output"]["untouched"]
    floating = {k for k, v in theta0.items() if v.is_floating_point()}
    assert set(untouched["names"]) == floating - merged_keys
    assert untouched["tensors"] == len(untouched["names"]) > 0


@pytest.fixture(scope="module")
def headless(tmp_path_factory):
    """Two query/value adapters without a saved head, and K-FAC curvatures of each from three
    texts: the pooler's (and the untouched head's) Gram has rank 3 < 8, singular."""
    root = tmp_path_factory.mktemp("headless")
    base = bert_classifier(root / "base")
    made = [
        _adapter(
            base, root / f"ad{t}", 30 + t, r=2, lora_alpha=4, target_modules=["query", "value"]
        )
        for t in range(2)
    ]
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in TEXTS))
    files = {
        kind: [
            _curvature(ad, data, root / f"{kind}{t}.safetensors", "kfac", *extra)
            for t, (ad, _) in enumerate(made)
        ]
        for kind, extra in (("restricted", ()), ("whole", ("--whole-model",)))
    }
    return root, base, made, files


def test_regmean_of_adapters_copies_the_untouched_pooler_whose_gram_is_singular(headless):
    root, base, made, files = headless
    with open_curvature(files["whole"][0]) as f:  # the reference: that Gram is singular
        pooler = f.restrict(["bert.pooler.dense.weight", "bert.pooler.dense.bias"])
    gram = pooler.terms["bert.pooler.dense"][0][0][:-1, :-1]
    assert torch.linalg.matrix_rank(gram) <= len(TEXTS) < gram.shape[0]
    theta0 = load_file(str(base / "model.safetensors"))
    for kind in ("whole", "restricted"):
        for inputs in ("adapters", "full"):
            config = {
                "method": "regmean",
                "base_model": str(base),
                "models": [
                    {"model": str(ad if inputs == "adapters" else full), "curvature": str(c)}
                    for (ad, full), c in zip(made, files[kind], strict=True)
                ],
            }
            if kind == "restricted" and inputs == "full":
                continue  # restricted files with full models: test_restricted_files_with_full_models
            merged, record = _merge(root, f"regmean-{kind}-{inputs}", config)
            for k in (
                "bert.pooler.dense.weight",
                "classifier.weight",
                "bert.embeddings.word_embeddings.weight",
            ):
                assert torch.equal(merged[k], theta0[k]), (kind, inputs, k)
                assert k in record["output"]["untouched"]["names"]
            query = "bert.encoder.layer.0.attention.self.query.weight"
            assert not torch.equal(merged[query], theta0[query])
    # --dry-run checks the systems of the merged units only: the pooler's is not one
    for inputs in ("adapters", "full"):
        dry = ["merge", str(root / f"regmean-whole-{inputs}.yaml"), str(root / "dry"), "--dry-run"]
        assert cli.main(dry) == 0 and not (root / "dry").exists()
    # the same merge with the adapters materialised reads the zero task vectors and copies
    a, b = (
        load_file(str(root / f"regmean-whole-{x}" / "model.safetensors"))
        for x in ("adapters", "full")
    )
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14, msg=k)


def test_restricted_files_with_full_models(headless):
    """Full checkpoints with curvatures restricted to their adapters: the tensors the files leave
    out are copied once checked equal to the base as read; a model that changes one is refused."""
    root, base, made, files = headless
    config = {
        "method": "gradient_matching",
        "base_model": str(base),
        "models": [
            {"model": str(full), "curvature": str(c)}
            for (_, full), c in zip(made, files["restricted"], strict=True)
        ],
        "prior": {"delta": 1.0},
    }
    merged, record = _merge(root, "gm-full-restricted", config)
    config["models"] = [
        {"model": str(ad), "curvature": str(c)}
        for (ad, _), c in zip(made, files["restricted"], strict=True)
    ]
    reference, _ = _merge(root, "gm-adapters-restricted", config)
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k], rtol=1e-12, atol=1e-14, msg=k)
    assert "bert.pooler.dense.weight" in record["output"]["untouched"]["names"]

    changed = load_file(str(made[1][1] / "model.safetensors"))
    changed["bert.pooler.dense.bias"] = changed["bert.pooler.dense.bias"] + 1.0
    (root / "changed").mkdir(exist_ok=True)
    save_file(changed, root / "changed" / "model.safetensors")
    (root / "changed" / "config.json").write_text((made[1][1] / "config.json").read_text())
    config["models"] = [
        {"model": str(made[0][1]), "curvature": str(files["restricted"][0])},
        {"model": str(root / "changed"), "curvature": str(files["restricted"][1])},
    ]
    with pytest.raises(StructureError, match=r"changes 'bert\.pooler\.dense\.bias'.*--whole-model"):
        run_merge(MergeConfig.from_dict(config, root=root), root / "refused", progress=False)
    assert not (root / "refused").exists()


def test_restricted_curvature_lacking_what_another_adapter_changes_is_refused(headless, tmp_path):
    _, base, made, files = headless
    other, _ = _adapter(base, tmp_path / "key", 7, r=2, lora_alpha=4, target_modules=["key"])
    config = {
        "method": "gradient_matching",
        "base_model": str(base),
        "models": [
            {"model": str(made[0][0]), "curvature": str(files["restricted"][0])},
            {"model": str(other), "curvature": str(files["restricted"][1])},
        ],
        "prior": {"delta": 1.0},
    }
    with pytest.raises(StructureError, match=r"its LoRA adapter changes only.*self\.key"):
        run_merge(MergeConfig.from_dict(config, root=tmp_path), tmp_path / "out", progress=False)


METHODS = {
    "task_arithmetic": {},
    "fisher_average": {"curvature": True},
    "gradient_matching": {"curvature": True, "prior": {"delta": 1e-3}},
    "tsv_merge": {},
    "iso_c": {},
    "iso_cts": {},
}


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_copies_a_tensor_no_model_changes(method, blocks, tmp_path, monkeypatch):
    """Full checkpoints where no model changes `frozen.weight`, whose curvature is zero (Fisher
    averaging's Σ α_t H_t is singular there): copied from the base, bit for bit, by every
    method, and named in the record; `w` is merged. ``blocks``: the elementwise methods merge
    each tensor a block of rows at a time, and each block is copied."""
    from gradmerge.jobs import job as job_module

    if blocks:
        monkeypatch.setattr(job_module, "ROW_BLOCK_BYTES", 16)
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(4, 6, generator=g), "frozen.weight": torch.randn(5, 3, generator=g)}
    save_file(base, tmp_path / "base.safetensors")
    models = []
    for t in range(2):
        ft = {
            "w": base["w"] + torch.randn(4, 6, generator=g),
            "frozen.weight": base["frozen.weight"],
        }
        save_file(ft, tmp_path / f"ft{t}.safetensors")
        models.append({"model": f"ft{t}.safetensors", "alpha": 0.5})
    if METHODS[method].get("curvature"):
        gm.Diagonal(
            {"w": torch.rand(4, 6, generator=g) + 0.1, "frozen.weight": torch.zeros(5, 3)}
        ).save(tmp_path / "c.safetensors")
        for m in models:
            m["curvature"] = "c.safetensors"
    config = {"method": method, "base_model": "base.safetensors", "models": models}
    if "prior" in METHODS[method]:
        config["prior"] = METHODS[method]["prior"]
    report = run_merge(
        MergeConfig.from_dict(config, root=tmp_path), tmp_path / "out", progress=False
    )
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["frozen.weight"], base["frozen.weight"])
    assert not torch.equal(out["w"], base["w"])
    record = json.loads((report.out_dir / "gradmerge_merge.json").read_text())
    assert record["output"]["untouched"]["names"] == ["frozen.weight"]


def test_whole_model_applies_to_adapters_only(adapters, tmp_path, capsys):
    _, base, _, data = adapters
    with pytest.raises(SystemExit) as exit_:
        cli.main(
            ["curvature", str(base), str(data), str(tmp_path / "c.safetensors"), "--whole-model"]
        )
    assert exit_.value.code == 2
    assert "--whole-model applies to a LoRA adapter MODEL" in capsys.readouterr().err
    assert not (tmp_path / "c.safetensors").exists()
