"""``python -m benchmarks --device cuda``: headwise on a GPU against the same peers, in bfloat16.

Every group is paired and interleaved as on CPU (:mod:`benchmarks.timing`); a block's clock starts and stops
after ``torch.cuda.synchronize()``, and peak memory is ``torch.cuda.max_memory_allocated`` above the level
before the call. The groups and their peers:

* forward (no grad) and forward + backward at the issue's shapes, against :class:`~benchmarks.peers.PackedSDPA`;
* eager decode steps at b1 and b16 over a 1024-token context, against the plain ``x @ W`` loop with PyTorch's
  default SDPA and with cuDNN excluded, at positions seen before (every block rewinds to the same context) and
  at fresh positions (every entry decodes lengths no entry has run before, so cuDNN's per-shape plans are paid);
* the compiled step (``mode="reduce-overhead"``) against a gpt-fast-style compiled step (a static cache written
  with ``index_copy_`` at a device position, a mask over ``max_len``) and the eager plain loop;
* a patched 8-layer Llama's ``generate`` against the unpatched model at seen and fresh lengths (in every round
  of the fresh group the patched model gets the longer of two prompt lengths neither has run before), and
  capturing every head's ``result`` against a plain forward of the patched model;
* per-head statistics (:mod:`headwise.statistics`, the Triton kernel) of a Llama-8B-shaped layer at s32768,
  causal: lse, entropy and max_weight, and all four, against the layer's plain forward.

Shapes:
    b: batch, s: sequence, d: d_model, h: query heads, h_kv: key/value heads, d_h: head width.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from headwise import DecodeStep, MultiHeadAttention

from . import peers
from .report import Goal
from .timing import Entry, Group

__all__ = ["cuda_groups", "CUDA_CASES", "CUDA_GOALS", "Setup", "CUDA", "CPU_CHECK"]

#: The names ``--device cuda --only`` takes, in run order.
CUDA_CASES = ("forward", "backward", "decode", "compiled", "patched", "statistics")

@dataclass(frozen=True)
class Setup:
    """Where and at which sizes the groups run: the GPU run, or a CPU check of the machinery (tiny shapes,
    float32, compiled without CUDA graphs)."""

    device: str
    dtype: torch.dtype
    forwards: tuple[tuple[int, int, int, int, int], ...]  # (b, s, d, h, h_kv) of the forward and fwd+bwd groups
    decode: tuple[int, int, int, int, int]  # (d, h, h_kv, context, tokens per block)
    llama: dict
    new_tokens: int
    prompt: int
    trace: tuple[int, int]  # (b, s)
    compile: dict
    stats: tuple[int, int, int, int, int] = (1, 64, 64, 4, 2)  # (b, s, d, h, h_kv) of the statistics group


CUDA = Setup("cuda", torch.bfloat16,
             forwards=((8, 4096, 4096, 32, 32), (8, 4096, 4096, 32, 8), (16, 1024, 2048, 16, 16),
                       (1, 32768, 4096, 32, 8)),
             decode=(4096, 32, 8, 1024, 16),
             llama=dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=8,
                        intermediate_size=14336, vocab_size=32000),
             new_tokens=32, prompt=128, trace=(4, 2048), compile=dict(mode="reduce-overhead"),
             stats=(1, 32768, 4096, 32, 8))
#: The same groups on the CPU at tiny sizes (tests/bench): the machinery, not the figures.
CPU_CHECK = Setup("cpu", torch.float32, forwards=((2, 16, 32, 4, 4), (2, 16, 32, 4, 2)), decode=(32, 4, 2, 8, 2),
                  llama=dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                             intermediate_size=64, vocab_size=64),
                  new_tokens=3, prompt=6, trace=(2, 8), compile=dict(backend="eager"))
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_HW = "headwise"
PLAIN, PLAIN_NO_CUDNN = "plain loop", "plain loop, cuDNN excluded"
GPT_FAST = "gpt-fast-style compiled step"
STATS_THREE, STATS_ALL = "trace lse, entropy, max_weight", "trace all four statistics"


def _shape(b: int, s: int, d: int, h: int, h_kv: int) -> str:
    return f"b{b} s{s} d{d} h{h}" + (f"/{h_kv}" if h_kv != h else "")


CUDA_GOALS = (
    Goal("forward (no grad) vs packed SDPA, every shape", tuple(f"cuda forward {_shape(*f)}" for f in CUDA.forwards), _HW,
         ("packed SDPA",), 1.05),
    Goal("fwd+bwd vs packed SDPA, every shape", tuple(f"cuda fwd+bwd {_shape(*f)}" for f in CUDA.forwards), _HW,
         ("packed SDPA",), 1.05),
    Goal("eager decode step vs the fastest plain loop, seen positions",
         ("cuda decode b1 seen", "cuda decode b16 seen"), _HW, (PLAIN, PLAIN_NO_CUDNN), 1.15),
    Goal("eager decode step vs the fastest plain loop, fresh positions",
         ("cuda decode b1 fresh", "cuda decode b16 fresh"), _HW, (PLAIN, PLAIN_NO_CUDNN), 1.15),
    Goal("compiled step vs the faster of gpt-fast-style and the plain loop",
         ("cuda compiled decode b1", "cuda compiled decode b16"), f"{_HW} compiled", (GPT_FAST, PLAIN_NO_CUDNN),
         1.10),
    Goal("patched Llama generate vs unpatched, seen lengths", ("cuda generate b1 seen", "cuda generate b8 seen"),
         "headwise (patched)", ("HF Llama (unpatched)",), 1.03),
    Goal("patched Llama generate vs unpatched, fresh lengths", ("cuda generate b1 fresh", "cuda generate b8 fresh"),
         "headwise (patched)", ("HF Llama (unpatched)",), 1.00),
    Goal("every head's result vs a plain forward", "cuda trace result", "headwise trace", ("plain forward",), 1.15),
    Goal("lse, entropy and max_weight vs a plain forward", "cuda statistics", STATS_THREE, ("plain forward",), 1.30),
    Goal("all four statistics vs a plain forward", "cuda statistics", STATS_ALL, ("plain forward",), 2.00),
)


def _peak(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - before


def _group(setup: Setup, key: str, entries: list[Entry], base: str, **kw: Any) -> Group:
    kw.setdefault("rounds", 10 if setup.device == "cuda" else 2)
    kw.setdefault("block_s", 0.1 if setup.device == "cuda" else 0.01)
    kw.setdefault("tol", (2e-2, 1e-2))  # bfloat16: tests/TOLERANCES.md, the GPU benchmark row
    if setup.device != "cuda":
        kw["rounds"] = min(kw["rounds"], 2)
        kw["memory"] = False
    cuda = setup.device == "cuda"
    return Group(key, key.removeprefix("cuda ") + (" (bf16, CUDA)" if cuda else " (CPU check)"), entries,
                 base=base, sync=torch.cuda.synchronize if cuda else None, peak=_peak if cuda else None, **kw)


def _layer(setup: Setup, d: int, h: int, h_kv: int) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(d, h, h_kv, bias=False, device=setup.device, dtype=setup.dtype).eval()


def forward_group(setup: Setup, shape: tuple[int, int, int, int, int]) -> Group:
    b, s, d, h, h_kv = shape
    attn = _layer(setup, d, h, h_kv)
    packed = peers.PackedSDPA(attn).eval()
    x = torch.randn(b, s, d, device=setup.device, dtype=setup.dtype)

    def run(layer: nn.Module) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with torch.no_grad():
                return layer(x, causal=True)
        return call

    return _group(setup, f"cuda forward {_shape(*shape)}", [Entry(_HW, run(attn)), Entry("packed SDPA", run(packed))],
                  "packed SDPA", memory=True)


def backward_group(setup: Setup, shape: tuple[int, int, int, int, int]) -> Group:
    b, s, d, h, h_kv = shape
    attn = _layer(setup, d, h, h_kv).train()
    packed = peers.PackedSDPA(attn).train()
    x = torch.randn(b, s, d, device=setup.device, dtype=setup.dtype, requires_grad=True)
    grad = torch.randn(b, s, d, device=setup.device, dtype=setup.dtype)

    def train(layer: nn.Module) -> Callable[[], tuple[torch.Tensor, ...]]:
        params = list(layer.parameters())
        return lambda: torch.autograd.grad(layer(x, causal=True), [x, *params], grad)[:1]

    return _group(setup, f"cuda fwd+bwd {_shape(*shape)}",
                  [Entry(_HW, train(attn)), Entry("packed SDPA", train(packed))], "packed SDPA", memory=True,
                  notes=["outputs compared: the gradient to the input"])


def decode_group(setup: Setup, b: int, fresh: bool) -> Group:
    """One token per call. Seen: every block rewinds to the same context. Fresh: no rewinding, and each entry
    starts at its own context, so no entry decodes a length another has run (cuDNN's plan cache is process-wide);
    headwise gets the longest context (the most keys to read)."""
    d, h, h_kv, ctx, n = setup.decode
    rounds = 10 if setup.device == "cuda" else 2
    span = n * (rounds + 2)  # the positions one entry runs: the warm-up and every round's block
    max_len = ctx + 3 * span + 1
    attn = _layer(setup, d, h, h_kv)
    cache = attn.new_cache(b, max_len)
    plain, plain_nc = peers.XWDecoder(attn, b, max_len), peers.XWDecoder(attn, b, max_len, kernels=NO_CUDNN)
    step = DecodeStep(attn, cache)
    torch.manual_seed(1)
    prompt = torch.randn(b, ctx + 2 * span, d, device=setup.device, dtype=setup.dtype)
    x = torch.randn(b, 1, d, device=setup.device, dtype=setup.dtype)
    with torch.no_grad():
        kv = [p(prompt).view(b, -1, h_kv, d // h).transpose(1, 2) for p in (attn.k_proj, attn.v_proj)]
    starts = {PLAIN_NO_CUDNN: ctx, PLAIN: ctx + (span if fresh else 0), _HW: ctx + (2 * span if fresh else 0)}

    def fill_cache() -> None:
        cache.reset()
        with torch.no_grad():
            n0 = starts[_HW]
            cache.update(kv[0][:, :, :n0].contiguous(), kv[1][:, :, :n0].contiguous())

    resets = {_HW: fill_cache,
              PLAIN: partial(plain.fill, kv[0][:, :, :starts[PLAIN]], kv[1][:, :, :starts[PLAIN]]),
              PLAIN_NO_CUDNN: partial(plain_nc.fill, kv[0][:, :, :ctx], kv[1][:, :, :ctx])}
    fns = {_HW: step, PLAIN: plain, PLAIN_NO_CUDNN: plain_nc}
    entries = []
    for name in (_HW, PLAIN, PLAIN_NO_CUDNN):
        def one(fn=fns[name]) -> torch.Tensor:
            with torch.no_grad():
                return fn(x)
        # Fresh: rewound once, before the warm-up; every later block continues at lengths not run before.
        reset = _once(resets[name]) if fresh else resets[name]
        entries.append(Entry(name, one, reset=reset, number=n, compare=not fresh))
    return _group(setup, f"cuda decode b{b} {'fresh' if fresh else 'seen'}", entries, PLAIN_NO_CUDNN,
                  rounds=rounds, notes=[f"d{d} h{h}/{h_kv}, context {ctx}, {n} tokens per block"])


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done: list[bool] = []

    def first() -> None:
        if not done:
            fn()
            done.append(True)
    return first


class GptFastStep(nn.Module):
    """gpt-fast's decode step for one layer: a static cache written with ``index_copy_`` at a device position,
    attention over the whole ``max_len`` buffer under a mask (K/V repeated, as gpt-fast does), the position
    advanced on the device."""

    def __init__(self, attn: MultiHeadAttention, b: int, max_len: int) -> None:
        super().__init__()
        cfg = attn.config
        self.h, self.h_kv, self.d_h = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        self.wqkv = nn.Parameter(w.contiguous(), requires_grad=False)
        self.wo = nn.Parameter(attn.out_proj.weight.detach().contiguous(), requires_grad=False)
        shape = (b, self.h_kv, max_len, self.d_h)
        self.register_buffer("k_cache", torch.zeros(shape, device=w.device, dtype=w.dtype))
        self.register_buffer("v_cache", torch.zeros(shape, device=w.device, dtype=w.dtype))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=w.device))
        self.register_buffer("slots", torch.arange(max_len, device=w.device))

    def fill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        self.k_cache[:, :, :n].copy_(k)
        self.v_cache[:, :, :n].copy_(v)
        self.pos.fill_(n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = F.linear(x, self.wqkv).split([self.h * self.d_h, self.h_kv * self.d_h, self.h_kv * self.d_h], -1)
        q = q.view(b, 1, self.h, self.d_h).transpose(1, 2)  # (b, h, 1, d_h)
        k = k.view(b, 1, self.h_kv, self.d_h).transpose(1, 2)  # (b, h_kv, 1, d_h)
        v = v.view(b, 1, self.h_kv, self.d_h).transpose(1, 2)
        self.k_cache.index_copy_(2, self.pos, k)
        self.v_cache.index_copy_(2, self.pos, v)
        mask = (self.slots <= self.pos).view(1, 1, 1, -1)  # (1, 1, 1, max_len)
        g = self.h // self.h_kv
        o = F.scaled_dot_product_attention(q, self.k_cache.repeat_interleave(g, 1),
                                           self.v_cache.repeat_interleave(g, 1), attn_mask=mask)  # (b, h, 1, d_h)
        self.pos.add_(1)
        return F.linear(o.transpose(1, 2).reshape(b, 1, self.h * self.d_h), self.wo)  # (b, 1, d)


def compiled_group(setup: Setup, b: int) -> Group:
    d, h, h_kv, ctx, n = setup.decode
    rounds = 10 if setup.device == "cuda" else 2
    max_len = ctx + n * (rounds + 4)
    attn = _layer(setup, d, h, h_kv)
    cache = attn.new_cache(b, max_len)
    plain_nc = peers.XWDecoder(attn, b, max_len, kernels=NO_CUDNN)
    gpt = GptFastStep(attn, b, max_len)
    step = torch.compile(DecodeStep(attn, cache), fullgraph=True, **setup.compile)
    gpt_step = torch.compile(gpt, fullgraph=True, **setup.compile)
    torch.manual_seed(1)
    prompt = torch.randn(b, ctx, d, device=setup.device, dtype=setup.dtype)
    x = torch.randn(b, 1, d, device=setup.device, dtype=setup.dtype)
    with torch.no_grad():
        kv = [p(prompt).view(b, ctx, h_kv, d // h).transpose(1, 2).contiguous() for p in (attn.k_proj, attn.v_proj)]

    def fill_cache() -> None:
        cache.reset()
        with torch.no_grad():
            cache.update(*kv)

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def one() -> torch.Tensor:
            with torch.no_grad():
                return fn(x).clone()  # a CUDA graph's output is overwritten by its next replay
        return one

    entries = [Entry(f"{_HW} compiled", run(step), reset=fill_cache, number=n,
                     note='torch.compile(DecodeStep(attn, cache), mode="reduce-overhead", fullgraph=True)'),
               Entry(GPT_FAST, run(gpt_step), reset=partial(gpt.fill, *kv), number=n,
                     note="static cache, index_copy_ at a device position, mask over max_len"),
               Entry(PLAIN_NO_CUDNN, run(plain_nc), reset=partial(plain_nc.fill, *kv), number=n, note="eager")]
    return _group(setup, f"cuda compiled decode b{b}", entries, GPT_FAST, rounds=rounds,
                  notes=[f"d{d} h{h}/{h_kv}, context {ctx}, max_len {max_len}, {n} tokens per block"])


def _llama_pair(setup: Setup) -> tuple[nn.Module, nn.Module]:
    import transformers

    from headwise.interop import patch

    from .hf import sharing_weights

    cfg = transformers.LlamaConfig(**setup.llama, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(setup.device):
        plain = transformers.LlamaForCausalLM._from_config(cfg, dtype=setup.dtype).eval()
    return plain, patch(sharing_weights(plain))


def generate_group(setup: Setup, b: int, fresh: bool, pair: tuple[nn.Module, nn.Module]) -> Group:
    """Greedy generation after a prompt. Fresh: each call of each entry runs a prompt length (so decode lengths
    too) that no call has run before in this process. The k-th call of each entry (its warm-up, then one per
    round) is a pair: the unpatched model's prompt at an even step, the patched model's one step longer, so
    within a round the patched model always has the more tokens to process, whichever entry runs first."""
    plain, patched = pair
    new, s0 = setup.new_tokens, setup.prompt
    step = new + 4  # > new: one call's decode lengths (prompt .. prompt + new) never reach the next's prompt
    torch.manual_seed(2)
    ids = torch.randint(3, setup.llama["vocab_size"], (b, s0 + 2 * b + 60 * step), device=setup.device)

    def gen(model: nn.Module, first: int) -> Callable[[], torch.Tensor]:
        lengths = itertools.count(s0 + 2 * b + first * step, 2 * step)

        def one() -> torch.Tensor:
            s = next(lengths) if fresh else s0
            with torch.no_grad():
                return model.generate(ids[:, :s], attention_mask=torch.ones_like(ids[:, :s]), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0)[:, s:]
        return one

    # Tokens are compared in float32 only: in bfloat16 the two models' kernels (flash or cuDNN) round differently and
    # greedy choices between near-equal logits may differ (tests/gpu compares float32 tokens and bf16 logits).
    same = not fresh and setup.dtype == torch.float32
    entries = [Entry("headwise (patched)", gen(patched, 1), number=1, compare=same),
               Entry("HF Llama (unpatched)", gen(plain, 0), number=1, compare=same)]
    cfg = setup.llama
    return _group(setup, f"cuda generate b{b} {'fresh' if fresh else 'seen'}", entries, "HF Llama (unpatched)",
                  rounds=6 if fresh else 10, tol=(0.0, 0.0),
                  notes=[f"{cfg['num_hidden_layers']}-layer Llama (d{cfg['hidden_size']} "
                         f"h{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}), {new} new tokens, sdpa, "
                         f"DynamicCache"])


def trace_group(setup: Setup, pair: tuple[nn.Module, nn.Module]) -> Group:
    import headwise

    _, patched = pair
    b, s = setup.trace
    torch.manual_seed(3)
    ids = torch.randint(3, setup.llama["vocab_size"], (b, s), device=setup.device)

    def plain() -> torch.Tensor:
        with torch.no_grad():
            return patched(ids).logits

    def traced() -> torch.Tensor:
        with torch.no_grad(), headwise.trace(patched, capture=("result",)):
            return patched(ids).logits

    return _group(setup, "cuda trace result", [Entry("headwise trace", traced), Entry("plain forward", plain)],
                  "plain forward", rounds=6, notes=[f"the patched Llama above, b{b} s{s}: every head's result captured"])


def statistics_group(setup: Setup) -> Group:
    """One layer's causal forward, plain and traced for per-head statistics (the fused kernel on CUDA, query
    chunks in the CPU check): the three row statistics, then all four (the key pass too)."""
    import headwise

    b, s, d, h, h_kv = setup.stats
    attn = _layer(setup, d, h, h_kv)
    torch.manual_seed(4)
    x = torch.randn(b, s, d, device=setup.device, dtype=setup.dtype)

    def run(capture: tuple[str, ...]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with torch.no_grad(), headwise.trace(attn, capture=capture):
                return attn(x, causal=True)
        return call

    def plain() -> torch.Tensor:
        with torch.no_grad():
            return attn(x, causal=True)

    with torch.no_grad():
        info = attn.explain_dispatch(x, causal=True, statistics=headwise.plan.STATISTICS)
    entries = [Entry("plain forward", plain, note="attn(x, causal=True), no trace"),
               Entry(STATS_THREE, run(("lse", "entropy", "max_weight")), note=f"kernel: {info.kernel}"),
               Entry(STATS_ALL, run(headwise.plan.STATISTICS), note="+ key_weight (the key-blocked pass)")]
    return _group(setup, "cuda statistics", entries, "plain forward", rounds=5, memory=True,
                  notes=[f"one layer {_shape(b, s, d, h, h_kv)}, causal; outputs compared: the layer's output"])


def cuda_groups(only: list[str] | None = None, setup: Setup = CUDA) -> list[Callable[[], Group]]:
    """Factories of every group (``only``: the subset of forward, backward, decode, compiled, patched,
    statistics)."""
    want = set(only or CUDA_CASES)
    unknown = want - set(CUDA_CASES)
    if unknown:
        raise ValueError(f"--only with --device cuda takes {', '.join(CUDA_CASES)}; got {', '.join(sorted(unknown))}")
    out: list[Callable[[], Group]] = []
    if "forward" in want:
        out += [partial(forward_group, setup, f) for f in setup.forwards]
    if "backward" in want:
        out += [partial(backward_group, setup, f) for f in setup.forwards]
    if "decode" in want:
        out += [partial(decode_group, setup, b, fresh) for b in (1, 16) for fresh in (False, True)]
    if "compiled" in want:
        out += [partial(compiled_group, setup, b) for b in (1, 16)]
    if "patched" in want:
        held: list[tuple[nn.Module, nn.Module]] = []

        def pair() -> tuple[nn.Module, nn.Module]:
            if not held:
                held.append(_llama_pair(setup))
            return held[0]

        out += [lambda b=b, fresh=fresh: generate_group(setup, b, fresh, pair()) for b in (1, 8)
                for fresh in (False, True)]
        out += [lambda: trace_group(setup, pair())]
    if "statistics" in want:
        out.append(partial(statistics_group, setup))
    return out
