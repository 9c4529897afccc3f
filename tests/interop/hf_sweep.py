"""One row of docs/interop_hf_families.md's table: build a model type tiny, patch it, and check what works.

Every cell is a check that ran: ``patch`` (the conventions kept: the implementation the model had), ``equal``
(patched logits vs the unpatched model, float32 default tolerances), ``padded`` (the same with a left-padded row,
at every position: the padded ones too), ``trace`` (z and pattern captured with the shapes of the heads transformers handed over),
``result`` (the heads' writes sum to the output of the module that reads z), ``heads`` (``attn.head(i)`` weight
views; the captured V of layer 0 equals each head's ``project`` of the module input: its W_V plus b_V, or for
multi-head latent attention its W_V applied to the module's kv latent) and ``surgery`` (``prune_heads`` of head 0
of every layer equals the unpatched model with forward pre-hooks zeroing head 0's slice of each layer's W_O
input). A cell says ``no: <why>`` otherwise.
Run ``python -m tests.interop.hf_sweep`` to print every row (what test_hf_table writes under its switch).
"""

from __future__ import annotations

import contextlib
import copy
import signal
import time
from typing import Any

import torch

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, d_model=16, n_embd=16, n_head=4, n_layer=2, num_layers=2, num_heads=4,
             d_kv=4, d_ff=32, ffn_dim=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
             n_positions=64, max_source_positions=16, num_mel_bins=8, image_size=16, patch_size=4, num_channels=3, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, decoder_start_token_id=0, num_local_experts=2, num_experts=2, num_experts_per_tok=1,
             n_routed_experts=2, moe_intermediate_size=8, n_shared_experts=1)
# Families whose defaults outgrow SMALL (latent ranks, expert groups).
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=6, first_k_dense_replace=0, n_group=1, topk_group=1),
    "deepseek_v2": dict(num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=6, first_k_dense_replace=0, n_group=1, topk_group=1),
    "gemma2": dict(head_dim=4, query_pre_attn_scalar=4),
    "gemma3_text": dict(head_dim=4, query_pre_attn_scalar=4),
    "gpt_oss": dict(head_dim=4),
    "codegen": dict(rotary_dim=2),
    "gptj": dict(rotary_dim=2),
}
MAX_PARAMS = 8_000_000  # a "tiny" config that still builds this big has sizes SMALL does not reach
BUDGET_S = 10  # seconds per family; slower ones are listed as not run
COLUMNS = ("model_type", "class", "patch", "equal", "padded", "trace", "result", "heads", "surgery")


class _Slow(Exception):
    pass


@contextlib.contextmanager
def _budget(seconds: int):
    def stop(*_: Any) -> None:
        raise _Slow(f"took over {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:90].rstrip()}".replace("|", "/")


def _config(transformers: Any, model_type: str) -> Any:
    """The tiny config: every SMALL size, else (a config that refuses some) only the sizes it has by default."""
    sizes = {**SMALL, **OVERRIDES.get(model_type, {})}
    try:
        return transformers.AutoConfig.for_model(model_type, **sizes)
    except Exception:  # noqa: BLE001 - retried with fewer sizes; a second failure is the row's reason
        default = transformers.AutoConfig.for_model(model_type)
        return transformers.AutoConfig.for_model(model_type, **{k: v for k, v in sizes.items() if hasattr(default, k)})


def _model_class(transformers: Any, config: Any) -> type:
    for mapping in (transformers.MODEL_FOR_CAUSAL_LM_MAPPING, transformers.MODEL_MAPPING):
        with contextlib.suppress(KeyError):
            return mapping[type(config)]
    raise KeyError(f"no model class for {type(config).__name__}")


def _inputs(model: Any, config: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        vocab = min(int(getattr(config, "vocab_size", 64) or 64), 64)
        ids = torch.randint(3, vocab, (2, 5), generator=g)
        batch = {"input_ids": ids}
        if getattr(config, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = ids[:, :4]
        return batch
    if name == "input_features" and isinstance(getattr(config, "num_mel_bins", None), int):
        frames = 2 * getattr(config, "max_source_positions", 16)  # Whisper's encoder halves the frames once
        batch = {"input_features": torch.randn(2, config.num_mel_bins, frames, generator=g)}
        if getattr(config, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = torch.randint(3, 64, (2, 4), generator=g)
        return batch
    if name == "pixel_values":
        size, channels = getattr(config, "image_size", 16), getattr(config, "num_channels", 3)
        if isinstance(size, int) and isinstance(channels, int):
            return {"pixel_values": torch.randn(2, channels, size, size, generator=g)}
    raise ValueError(f"input {name!r} not built by this sweep")


def _padded(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | str:
    """``batch`` with its second row's first two tokens padded (left padding), or why there is none to give."""
    import inspect

    if "input_ids" not in batch:
        return f"n/a: {model.main_input_name} inputs, no padding"
    if "attention_mask" not in inspect.signature(model.forward).parameters:
        return "n/a: the model takes no attention_mask"
    mask = torch.ones_like(batch["input_ids"])
    mask[1, :2] = 0
    return {**batch, "attention_mask": mask}


def _output(model: Any, batch: dict) -> torch.Tensor:
    torch.manual_seed(1)  # families that draw noise in their forward (ViT-MAE's masking) draw the same
    with torch.no_grad():
        out = model(**batch)
    for key in ("logits", "last_hidden_state"):
        t = getattr(out, key, None)
        if isinstance(t, torch.Tensor):
            return t
    return next(t for t in out.to_tuple() if isinstance(t, torch.Tensor))


def row(model_type: str) -> dict[str, str]:
    """Every column of ``model_type``'s row (see the module docstring)."""
    import transformers

    import headwise
    from headwise.interop import layers, patch
    from headwise.surgery import prune_heads

    cells = dict.fromkeys(COLUMNS, "")
    cells["model_type"] = model_type
    try:
        with _budget(BUDGET_S):
            config = _config(transformers, model_type)
            cls = _model_class(transformers, config)
            cells["class"] = cls.__name__
            with torch.device("meta"):
                n = sum(p.numel() for p in cls(config).parameters())
            if n > MAX_PARAMS:
                raise ValueError(f"{n / 1e6:.1f}M parameters at the tiny sizes")
            torch.manual_seed(0)
            model = cls(config).eval()
            batch = _inputs(model, config)
            want = _output(model, batch)
            padded = _padded(model, batch)
    except BaseException as e:  # noqa: BLE001 - every failure is a table cell
        if isinstance(e, KeyboardInterrupt):
            raise
        cells["patch"] = f"not run: {_why(e)}"
        return cells
    if isinstance(padded, dict):
        try:
            with _budget(BUDGET_S):
                want_padded = _output(model, padded)
        except BaseException as e:  # noqa: BLE001 - the unpatched model itself cannot take the padding
            if isinstance(e, KeyboardInterrupt):
                raise
            padded = f"n/a: unpatched, it fails with padding ({_why(e)})"
    try:
        with _budget(BUDGET_S):
            patch(model)
            rules = sorted({attn.rule for _, attn in layers(model)})
            cells["patch"] = "yes (" + ", ".join(rules) + ")"
            got = _output(model, batch)
            torch.testing.assert_close(got, want)
            cells["equal"] = "yes"
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        cells["patch" if not cells["patch"] else "equal"] = f"no: {_why(e)}"
        if not cells["patch"].startswith("yes"):
            return cells
    try:
        with _budget(BUDGET_S):
            if isinstance(padded, str):
                cells["padded"] = padded
            else:
                torch.testing.assert_close(_output(model, padded), want_padded)
                cells["padded"] = "yes"
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        cells["padded"] = f"no: {_why(e)}"
    checks = (("trace", _trace), ("result", _result), ("heads", _heads), ("surgery", _surgery))
    for column, check in checks:
        try:
            with _budget(BUDGET_S):
                check(model, batch, headwise, layers, prune_heads)
            cells[column] = "yes"
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            cells[column] = f"no: {_why(e)}"
    return cells


def _trace(model, batch, headwise, layers, prune_heads) -> None:  # type: ignore[no-untyped-def]
    with headwise.trace(model, capture=("z", "pattern")) as t:
        _output(model, batch)
    called = [(record, attn) for record, (_, attn) in zip(t, layers(model)) if record.calls]
    if not called:
        raise ValueError("no patched layer was called")
    for record, attn in called:  # cross-attention without encoder states is not called
        z, p = record.calls[0]["z"], record.calls[0]["pattern"]
        if z.shape[2:] != (attn.n_heads, attn.d_head) or p.shape[1] != attn.n_heads:
            raise ValueError(f"{record.name}: z {tuple(z.shape)}, pattern {tuple(p.shape)} for h={attn.n_heads}")
        rows = p.sum(-1)  # 1, or less where attention sinks (gpt-oss) take part of each row
        if (p < 0).any() or (rows > 1 + 1e-5).any() or not (rows > 0).any():
            raise ValueError(f"{record.name}: pattern rows are not probabilities (sums {rows.min()}..{rows.max()})")


def _result(model, batch, headwise, layers, prune_heads) -> None:  # type: ignore[no-untyped-def]
    name, attn = layers(model)[0]
    o = attn.out_proj
    seen: dict[str, tuple] = {}
    module = o if isinstance(o, torch.nn.Module) else getattr(attn.host, "c_proj", None)  # GPT-2: a Conv1D view
    if module is None:
        raise ValueError("W_O is not a module")

    def grab(m, args, out):  # type: ignore[no-untyped-def]
        seen.setdefault("io", (args[0], out))

    handle = module.register_forward_hook(grab)
    try:
        with headwise.trace(model, capture={0: ("z", "result")}) as t:
            _output(model, batch)
    finally:
        handle.remove()
    z, result = t[0].calls[0]["z"], t[0].calls[0]["result"]
    x, y = seen["io"]
    torch.testing.assert_close(x, z.reshape(*z.shape[:2], -1))  # the located W_O reads the heads' context
    bias = 0 if o.bias is None else o.bias
    torch.testing.assert_close(result.sum(2) + bias, y)


def _heads(model, batch, headwise, layers, prune_heads) -> None:  # type: ignore[no-untyped-def]
    name, attn = layers(model)[0]
    heads = attn.heads()
    seen: dict[str, torch.Tensor] = {}

    def grab(m, args, kwargs):  # type: ignore[no-untyped-def]
        x = kwargs.get("hidden_states", args[0] if args else None)
        seen.setdefault("x", x)

    handle = attn.host.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with headwise.trace(model, capture={0: ("v",)}) as t:
            _output(model, batch)
    finally:
        handle.remove()
    v, x = t[0].calls[0]["v"], seen["x"]
    with torch.no_grad():  # project(x)'s V: x @ w_v + b_v, or the latent's under multi-head latent attention
        want = torch.stack([heads[j * attn.config.group_size].project(x)[2] for j in range(attn.n_kv_heads)], dim=1)
    torch.testing.assert_close(v, want)


def _surgery(model, batch, headwise, layers, prune_heads) -> None:  # type: ignore[no-untyped-def]
    """Head 0 of every layer pruned equals the unpatched model with a forward pre-hook on each layer's W_O that
    zeroes head 0's slice of its input (W_O's bias stays)."""
    from headwise.interop import unpatch

    names = {id(m): n for n, m in model.named_modules()}
    targets = []
    for _, attn in layers(model):
        o = attn.out_proj  # refuses, saying why, where W_O is not located
        module = o if isinstance(o, torch.nn.Module) else attn.host.c_proj  # GPT-2: a view of the Conv1D
        targets.append((names[id(module)], attn.d_head))
    ref = unpatch(copy.deepcopy(model))
    called = []
    for name, d_h in targets:
        def zero(m, args, d_h=d_h):  # type: ignore[no-untyped-def]
            called.append(name)
            z = args[0].clone()
            z[..., :d_h] = 0
            return (z,)
        ref.get_submodule(name).register_forward_pre_hook(zero)
    want = _output(ref, batch)
    if not called:
        raise ValueError("no located W_O was called")
    small = prune_heads(copy.deepcopy(model), {i: [0] for i in range(len(targets))})
    torch.testing.assert_close(_output(small, batch), want)
    lost = {name: why for name, attn in layers(small) for why in getattr(attn, "located", {}).values() if why}
    if lost:  # the resized modules must still be located by the next patch
        raise ValueError(f"after pruning: {lost}")


def all_rows() -> list[dict[str, str]]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    import transformers

    transformers.logging.set_verbosity_error()
    return [row(model_type) for model_type in sorted(CONFIG_MAPPING_NAMES)]


def markdown(rows: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    start = time.perf_counter()
    rows = all_rows()
    print(markdown(rows))
    print(f"\n{sum(r['equal'] == 'yes' for r in rows)} equal of {len(rows)}; {time.perf_counter() - start:.0f} s")
