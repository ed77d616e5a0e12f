"""The forms of MODEL and DATA that the commands accept, as their ``--help`` shows them.

A module of its own, importing nothing, so that ``gradmerge curvature --help`` prints it without
loading torch or the readers (:mod:`gradmerge.io.sources` re-exports it as ``sources.FORMS``).
"""

BATCH_SIZE = 16
"""Examples per batch of a tensor or text DATA file, by default (``--batch-size``, a refinement's
``batch_size``, :func:`gradmerge.io.sources.load_data`)."""

FORMS = """\
MODEL is either

- a Hugging Face model folder (config.json naming the class in architectures,
  safetensors weights), loaded offline with that transformers class; or
- a Python entry point module:function or path/to/file.py:function: a function returning
  the nn.Module (the current folder is importable, as with python -m), called with the
  keyword arguments given as --model-arg KEY=VALUE (none by default).

DATA is one of

- text: .jsonl, .csv/.tsv, .txt or a datasets folder (save_to_disk),
  tokenised with the MODEL folder's tokenizer, for sequence classification (a label per example)
  or causal language modelling (gradmerge.io.text_data);
- a tensor file (.safetensors, or .pt/.pth read with torch.load(weights_only=True))
  holding inputs and targets, or input_ids and labels (optionally
  attention_mask, token_type_ids), cut into batches (TensorBatches); labels
  either one per position, or one class per sequence, shape (examples,);
- an entry point returning an iterable of batches, as gradmerge.estimate_curvature
  accepts: (inputs, targets) pairs or Hugging Face dicts with "labels", called with the
  keyword arguments given as --data-arg KEY=VALUE, so that one function serves several tasks
  (--data-arg task=sentiment); its first --max-examples examples, and at most 10,000,000
  without it (an iterator that does not end stops with an error).

An entry point RUNS CODE: its module is imported and its function called, with your
permissions, as python -c "import module" would. Name only code you trust, and trust a YAML
file that names one (gradmerge refine) as you would a script: gradmerge refuses entry points in
YAML files unless --allow-entry-points or GRADMERGE_ALLOW_ENTRY_POINTS=1 says so
(docs/trust.md). Folders and files are only read, never run: weights through safetensors (or
torch.load(weights_only=True)), models by the transformers class their config names (no remote
code), YAML with a safe loader.
"""
"""The forms of MODEL and DATA, as ``gradmerge curvature --help`` shows them."""
