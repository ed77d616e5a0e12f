r"""The demo's model: a one-hidden-layer tanh MLP, with its exact loss Hessian in closed form.

The network is ``nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, C))``; its parameters,
flattened in ``named_parameters`` order (``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``:
:func:`gradmerge.params.flatten`), form θ. Per example, with x̃ = [x; 1], V₁ = [W₁ | b₁],
V₂ = [W₂ | b₂]:

.. math::

    z = V_1 \tilde x,\quad a = \tanh z,\quad \tilde a = [a; 1],\quad f = V_2 \tilde a,\quad
    \ell = -\log \mathrm{softmax}(f)_y,

and with p = softmax(f), r = p − e_y (= ∂ℓ/∂f), Λ = diag(p) − ppᵀ (= ∂²ℓ/∂f²), σ' = 1 − a²,
σ'' = −2aσ', u = W₂ᵀr, the exact Hessian of ℓ in vec(V₁), vec(V₂) (row-major) has the blocks

.. math::

    H_{22} = \Lambda \otimes \tilde a \tilde a^\top, \qquad
    H_{11} = \big(D W_2^\top \Lambda W_2 D + \mathrm{diag}(\sigma'' \odot u)\big)
        \otimes \tilde x \tilde x^\top, \quad D = \mathrm{diag}(\sigma'),

    (H_{12})_{(j,a),(c,k)} = \tilde x_a \sigma'_j \big[(\Lambda W_2)_{cj} \tilde a_k
        + r_c [k = j]\big].

:meth:`MLP.hessian` sums w_i times these over the examples in a few matrix products, much
faster than ``torch.func.hessian`` (which runs one forward-over-reverse pass per parameter);
the tests compare it with ``torch.func.hessian``. It makes Newton's method affordable, so that
every MAP of the demo is converged to machine precision.

Example:
    >>> import torch
    >>> from gradmerge.demo.mlp import MLP
    >>> mlp = MLP(hidden=3, inputs=4, classes=2)
    >>> theta = mlp.init(seed=0)
    >>> x, y, w = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1]), torch.ones(5)
    >>> H = mlp.hessian(theta, x, y, w.double())
    >>> reference = torch.func.hessian(lambda t: mlp.losses(t, x, y).sum())(theta)
    >>> torch.allclose(H, reference)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradmerge import params as P


@dataclass(frozen=True)
class MLP:
    """64 → ``hidden`` (tanh) → 10 by default; θ is a flat vector in ``named_parameters`` order."""

    hidden: int
    inputs: int = 64
    classes: int = 10
    _perm: dict[str, Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def module(
        self, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"
    ) -> nn.Sequential:
        """The same network as an ``nn.Sequential`` (in eval mode), e.g. for curvature
        estimators."""
        net = nn.Sequential(
            nn.Linear(self.inputs, self.hidden), nn.Tanh(), nn.Linear(self.hidden, self.classes)
        )
        return net.to(device=device, dtype=dtype).eval()

    @property
    def layout(self) -> P.Layout:
        """Names and shapes of the parameters, in flattening order."""
        h, d, c = self.hidden, self.inputs, self.classes
        return (
            ("0.weight", torch.Size((h, d))),
            ("0.bias", torch.Size((h,))),
            ("2.weight", torch.Size((c, h))),
            ("2.bias", torch.Size((c,))),
        )

    @property
    def num_params(self) -> int:
        """P = h(d + 1) + C(h + 1)."""
        return self.hidden * (self.inputs + 1) + self.classes * (self.hidden + 1)

    def init(
        self, *, seed: int, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"
    ) -> Tensor:
        """PyTorch's default initialisation of the layers, drawn from a generator seeded
        ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        parts = []
        fan_ins = (self.inputs, self.inputs, self.hidden, self.hidden)
        for (_, shape), fan_in in zip(self.layout, fan_ins, strict=True):
            bound = 1.0 / fan_in**0.5  # nn.Linear: U(−1/√fan_in, 1/√fan_in) for W and b
            draw = torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1
            parts.append((bound * draw).reshape(-1))
        return torch.cat(parts).to(device=device, dtype=dtype)

    def params(self, theta: Tensor) -> dict[str, Tensor]:
        """θ as a parameter dict (views of ``theta``)."""
        return P.unflatten(theta, self.layout)

    def flat(self, params: P.Params) -> Tensor:
        """A parameter dict as θ."""
        return P.flatten(params, self.layout)

    def logits(self, theta: Tensor, x: Tensor) -> Tensor:
        """f_θ(x), shape (n, C)."""
        p = self.params(theta)
        hidden = torch.tanh(torch.addmm(p["0.bias"], x, p["0.weight"].T))
        return torch.addmm(p["2.bias"], hidden, p["2.weight"].T)

    def losses(self, theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """ℓ_i(θ) = −log p(y_i | x_i, θ), shape (n,)."""
        return F.cross_entropy(self.logits(theta, x), y, reduction="none")

    def hessian(self, theta: Tensor, x: Tensor, y: Tensor, weights: Tensor) -> Tensor:
        """The exact Hessian Σ_i w_i ∇²ℓ_i(θ), a (P, P) matrix in θ's order (module docstring)."""
        h, d, c = self.hidden, self.inputs, self.classes
        p = self.params(theta)
        w1, b1, w2, b2 = p["0.weight"], p["0.bias"], p["2.weight"], p["2.bias"]
        n = x.shape[0]
        ones = torch.ones(n, 1, dtype=x.dtype, device=x.device)
        xt = torch.cat([x, ones], dim=1)  # x̃ (n, d+1)
        a = torch.tanh(torch.addmm(b1, x, w1.T))
        at = torch.cat([a, ones], dim=1)  # ã (n, h+1)
        prob = torch.softmax(torch.addmm(b2, a, w2.T), dim=1)
        r = prob - F.one_hot(y, c).to(prob.dtype)  # ∂ℓ/∂f
        lam = torch.diag_embed(prob) - prob[:, :, None] * prob[:, None, :]  # ∂²ℓ/∂f²
        s1 = 1 - a.square()  # σ'
        s2 = -2 * a * s1  # σ''
        u = r @ w2  # W₂ᵀ r, (n, h)
        lw = lam @ w2  # Λ W₂, (n, C, h)
        wx = weights[:, None] * xt

        # H22 = Σ w Λ ⊗ ããᵀ  over (c, k), (c', k')
        h22 = torch.einsum("icd,ik,il->ckdl", weights[:, None, None] * lam, at, at)
        # H11 = Σ w M ⊗ x̃x̃ᵀ, M = D W₂ᵀΛW₂ D + diag(σ'' ⊙ u): one (h², n) @ (n, (d+1)²) product
        m = s1[:, :, None] * (w2.T @ lw) * s1[:, None, :]
        m = m + torch.diag_embed(s2 * u)
        xx = (wx[:, :, None] * xt[:, None, :]).reshape(n, -1)
        h11 = (m.reshape(n, -1).T @ xx).reshape(h, h, d + 1, d + 1).permute(0, 2, 1, 3)
        # H12 over (j, a), (c, k): x̃_a σ'_j [(ΛW₂)_{cj} ã_k + r_c [k = j]]
        b = s1[:, None, :] * lw  # (n, C, h): σ'_j (ΛW₂)_{cj}
        h12 = torch.einsum("ia,icj,ik->jack", wx, b, at)
        diag = torch.einsum("ia,ij,ic->jac", wx, s1, r)  # the k = j terms
        idx = torch.arange(h, device=x.device)
        h12[idx, :, :, idx] += diag

        p1, p2 = h * (d + 1), c * (h + 1)
        full = torch.empty(p1 + p2, p1 + p2, dtype=theta.dtype, device=theta.device)
        full[:p1, :p1] = h11.reshape(p1, p1)
        full[p1:, p1:] = h22.reshape(p2, p2)
        full[:p1, p1:] = h12.reshape(p1, p2)
        full[p1:, :p1] = full[:p1, p1:].T
        full = 0.5 * (full + full.T)  # exactly symmetric (the blocks are, up to rounding)
        perm = self._order(theta.device)
        return full[perm][:, perm]

    def _order(self, device: torch.device) -> Tensor:
        """Index of θ's entries in the augmented order vec([W₁|b₁]), vec([W₂|b₂])."""
        key = str(device)
        if key not in self._perm:
            h, d, c = self.hidden, self.inputs, self.classes
            aug1 = torch.arange(h * (d + 1)).reshape(h, d + 1)
            aug2 = h * (d + 1) + torch.arange(c * (h + 1)).reshape(c, h + 1)
            order = torch.cat(
                [aug1[:, :d].reshape(-1), aug1[:, d], aug2[:, :h].reshape(-1), aug2[:, h]]
            )
            self._perm[key] = order.to(device)
        return self._perm[key]
