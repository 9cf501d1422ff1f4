"""The "moe" role's reference: a mixture-of-experts feed-forward block (vLLM's `FusedMoE`).

`select_experts` routes each token to `top_k` of the experts by its router logits;
`fused_experts` runs every token through its experts' gated MLPs and sums their outputs by
the routing weights. Inside a captured or compiled step (`in_static_step()`) it takes a
fixed-shape path with no host read (`static_fused_experts`): a graph cannot hold the grouped
path's per-expert counts, which are read on the host. `fused_experts` is THE functional interface a device override
implements (a grouped GEMM, a Triton fused-MoE kernel): the same arguments, the same result.
The router itself (an `nn.Linear` hidden -> experts) stays outside `FusedMoE`, in the model's
sparse block, so the "linear" role can replace it.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrunner.device.capture_guard import in_static_step
from polyrunner.ops.gated_mlp import silu_and_mul

SCORING_FUNCS = ("softmax", "sigmoid")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights [T, k] float32, topk_ids [T, k] int32)` of `router_logits [T, E]`: the
    scores (softmax over all experts, or an elementwise sigmoid) in float32, the `top_k`
    largest per token, divided by their sum when `renormalize` (vLLM's `fused_topk`)."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"scoring must be one of {SCORING_FUNCS}, got {scoring!r}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """`[T, H]` in x's dtype: per token t, `sum_j topk_weights[t, j] * expert_e(x[t])` with
    `e = topk_ids[t, j]` and `expert_e(v) = w2[e] @ (silu(w13[e, :I] @ v) * (w13[e, I:] @ v))`.

    x `[T, H]`; w13 `[E, 2I, H]` (gate rows, then up rows); w2 `[E, H, I]`; topk_weights
    `[T, k]` float32; topk_ids `[T, k]` int32. The reference groups the `T * k` (token, expert)
    pairs by expert once (a stable sort), runs one matmul pair per expert that received tokens
    and sums the weighted rows back per token in float32 (`index_add_`). In a captured or
    compiled step: `static_fused_experts`, the same sums in the same order."""
    if in_static_step():
        return static_fused_experts(x, w13, w2, topk_weights, topk_ids)
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)                        # pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the one host sync
    token_of = order // k                                           # each sorted pair's token row
    xs = x[token_of]
    ys = torch.empty_like(xs)
    start = 0
    for expert, count in enumerate(counts):   # the reference's loop over experts (never over tokens)
        if count:
            rows = slice(start, start + count)
            ys[rows] = silu_and_mul(xs[rows] @ w13[expert].t()) @ w2[expert].t()
            start += count
    weighted = ys.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of, weighted).to(x.dtype)


def static_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_experts` with fixed shapes and no host read, for captured and compiled steps:
    every expert's MLP runs over every token and is summed by the token's routing weight for it
    (0 where the token is not routed there), experts in ascending order as the grouped path sums
    them. Costs num_experts / top_k times the routed work: device kernels (the "moe" role's
    overrides) are what serve large mixtures; this keeps the reference correct inside graphs."""
    tokens, experts = x.shape[0], w13.shape[0]
    combine = torch.zeros(tokens, experts, dtype=torch.float32, device=x.device)
    combine.scatter_(1, topk_ids.long(), topk_weights.float())
    out = torch.zeros(tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    for expert in range(experts):   # a loop over experts (fixed), never over tokens
        weight = combine[:, expert:expert + 1]
        y = silu_and_mul(x @ w13[expert].t()) @ w2[expert].t()
        out += torch.where(weight > 0, y.float() * weight, 0.0)   # 0, not 0 * inf, off the route
    return out.to(x.dtype)


ROLE_ATTRIBUTES = ("num_experts", "top_k", "intermediate", "renormalize", "scoring", "w13_weight", "w2_weight")


def keep_moe_attributes(dst: nn.Module, src: nn.Module, weights: bool = True) -> None:
    """Give an override `dst` the role attributes of the module `src` it replaces (the same
    parameter objects): what the "moe" role's contract says a replacement keeps. `weights=False`:
    the routing and size attributes only, for a replacement that holds the experts in a form of
    its own (quantized blocks) and no dense `w13_weight` / `w2_weight`."""
    for name in ROLE_ATTRIBUTES:
        if weights or not name.endswith("_weight"):
            setattr(dst, name, getattr(src, name))


class FusedMoE(nn.Module):
    """The experts of a sparse block (this rank's `intermediate` rows of each): parameters
    `w13_weight [E, 2 * intermediate, H]` (gate then up) and `w2_weight [E, H, intermediate]`.
    `forward(x [T, H], router_logits [T, E]) -> [T, H]` =
    `fused_experts(x, w13_weight, w2_weight, *select_experts(router_logits, top_k, renormalize, scoring))`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate: int,
                 renormalize: bool = True, scoring: str = "softmax") -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}")
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring must be one of {SCORING_FUNCS}, got {scoring!r}")
        self.num_experts, self.top_k, self.intermediate = num_experts, top_k, intermediate
        self.renormalize, self.scoring = renormalize, scoring
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate), requires_grad=False)

    # the experts' computation, `fused_experts`'s call: a device override may swap only this
    experts = staticmethod(fused_experts)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, self.scoring)
        return self.experts(x, self.w13_weight, self.w2_weight, weights, ids)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate}, "
                f"renormalize={self.renormalize}, scoring={self.scoring!r}")
