"""Compile, for a GPU target, every Triton kernel a Mamba2 layer of SGLang's engine launches on kvcached's states,
with the arguments the engine gives them (helper run by tests/test_sglang_mamba.py in its own process).

    python -m tests.sglang_mamba_compile [--target sm90] [--cases contiguous:bfloat16,per_layer:float16]

The calls are those of SGLang's ``MambaMixer2.forward`` with ``--mamba-backend triton`` (a mixed batch: prefills,
two going on from a state and one longer than the model's chunk, then decodes), on the states of kvcached's
``MambaPool`` (strided views) in the engine's dtypes: activations and weights in the model's ``dtype``, conv
states in SGLang's default bf16, SSM states float32. Nothing runs (``tests.compile_only``): a kernel that cannot be
compiled for these arguments fails here as at its first launch on the device. Prints one JSON line, a
result a case: the kernels compiled, or the first error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from types import SimpleNamespace

# the tiny Granite-4.0-H of tools/tiny_model.py (tests/gpu/test_sglang_gpu.py's hybrid); one group and a 4-wide
# convolution, as sglang_support.mamba2_params builds the states
INTER, HEADS, HEAD_DIM, STATE, GROUPS, CONV, CHUNK = 256, 8, 32, 16, 1, 4, 64
PREFILL_LENS, HAS_STATE = [5, 1, 70], [True, False, True]


def _mixer_calls(pool, dtype, layer: int) -> dict[str, list[int]]:
    """SGLang 0.5.17's ``MambaMixer2.forward`` (mamba.py) from its projections on, its kernel calls as written
    there: a prefill part and a decode part of one batch."""
    import torch
    from sglang.kernels.ops.attention.fla.layernorm_gated import rms_norm_gated
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn, causal_conv1d_update
    from sglang.kernels.ops.mamba.triton_ops import mamba_chunk_scan_combined, selective_state_update
    from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

    with contextlib.suppress(ImportError):  # the engine's choice, --mamba-backend triton, where a dispatcher picks it
        from sglang.kernels.ops.mamba.triton_ops.ssu_dispatch import initialize_mamba_selective_state_update_backend

        initialize_mamba_selective_state_update_backend(SimpleNamespace(
            mamba_backend="triton", enable_mamba_cache_stochastic_rounding=False, mamba_cache_philox_rounds=10))
    import sglang.kernels.ops.attention.fla.layernorm_gated as norm_module

    if hasattr(norm_module, "_get_sm_count"):  # the norm's rows a program follow the SM count: an H100's / H200's
        norm_module._get_sm_count = lambda device: 132
    cache = pool.mamba2_layer_cache(layer)
    conv_state, ssm_state = cache.conv[0], cache.temporal
    n_pre, n_dec = len(PREFILL_LENS), 2
    tokens = sum(PREFILL_LENS) + n_dec
    gstate = GROUPS * STATE
    conv_dim = INTER + 2 * gstate
    slots = pool.mamba_allocator.alloc(n_pre + n_dec).to(torch.int32)
    projected = torch.randn(tokens, INTER + conv_dim + HEADS).to(dtype)
    gate, xbc, dt = torch.split(projected, [INTER, conv_dim, HEADS], dim=-1)
    weight, bias = torch.randn(conv_dim, CONV).to(dtype), torch.randn(conv_dim).to(dtype)
    a = -torch.rand(HEADS, dtype=torch.float32)  # SGLang's A is a float32 parameter, D and dt_bias the model's
    d, dt_bias, norm_weight = torch.rand(HEADS).to(dtype), torch.rand(HEADS).to(dtype), torch.ones(INTER).to(dtype)
    out = torch.empty(tokens, HEADS * HEAD_DIM, dtype=dtype)

    def split_xbc(t):
        return torch.split(t, [INTER, gstate, gstate], dim=-1)

    # prefill: SGLang's mixed metadata for these lengths
    n_tok = sum(PREFILL_LENS)
    qsl = torch.tensor([0, *torch.tensor(PREFILL_LENS).cumsum(0).tolist()], dtype=torch.int32)
    has_state = torch.tensor(HAS_STATE)
    seq_idx = torch.repeat_interleave(torch.arange(n_pre, dtype=torch.int32), qsl.diff()).unsqueeze(0)
    chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(qsl, CHUNK, n_tok)
    xbc_p, xbc_d = torch.split(xbc[:tokens], [n_tok, n_dec], dim=0)
    dt_p, dt_d = torch.split(dt[:tokens], [n_tok, n_dec], dim=0)
    out_p, out_d = torch.split(out, [n_tok, n_dec], dim=0)
    xbc_p = causal_conv1d_fn(xbc_p.transpose(0, 1), weight, bias, activation="silu", conv_states=conv_state,
                             has_initial_state=has_state, cache_indices=slots[:n_pre], query_start_loc=qsl,
                             seq_lens_cpu=PREFILL_LENS).transpose(0, 1)[:n_tok]
    x_p, b_p, c_p = split_xbc(xbc_p)
    initial = torch.where(has_state[:, None, None, None], ssm_state[slots[:n_pre]], 0)
    _, varlen_state = mamba_chunk_scan_combined(
        x_p.view(1, n_tok, HEADS, HEAD_DIM), dt_p.unsqueeze(0), a, b_p.view(1, n_tok, GROUPS, -1),
        c_p.view(1, n_tok, GROUPS, -1), chunk_size=CHUNK, D=d, z=None, dt_bias=dt_bias, seq_idx=seq_idx,
        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, cu_seqlens=qsl, initial_states=initial,
        return_varlen_states=True, return_final_states=False, return_intermediate_states=True, dt_softplus=True,
        dt_limit=(0.0, float("inf")), out=out_p.view(1, n_tok, -1, HEAD_DIM), state_dtype=ssm_state.dtype)
    ssm_state[slots[:n_pre].long()] = varlen_state.to(ssm_state.dtype)

    # decode
    xbc_d = causal_conv1d_update(xbc_d, conv_state, weight, bias, "silu", conv_state_indices=slots[n_pre:])
    x_d, b_d, c_d = split_xbc(xbc_d)
    selective_state_update(
        ssm_state, x_d.view(-1, HEADS, HEAD_DIM), dt_d[:, :, None].expand(-1, -1, HEAD_DIM),
        a[:, None, None].expand(-1, HEAD_DIM, STATE).to(torch.float32), b_d.view(-1, GROUPS, STATE),
        c_d.view(-1, GROUPS, STATE), d[:, None].expand(-1, HEAD_DIM), z=None,
        dt_bias=dt_bias[:, None].expand(-1, HEAD_DIM), dt_softplus=True, state_batch_indices=slots[n_pre:],
        out=out_d.view(n_dec, -1, HEAD_DIM))
    # the gated RMS norm (Mixer2RMSNormGated.forward_cuda, one group)
    rms_norm_gated(x=out, weight=norm_weight, bias=None, z=gate, eps=1e-5, group_size=INTER,
                   norm_before_gate=False, is_rms_norm=True)
    return {"conv": list(conv_state.stride()), "temporal": list(ssm_state.stride())}


def _pool(contiguous: bool):
    """SGLang's ``HybridReqToTokenPool`` with kvcached's states (the hooks installed), in one layout."""
    from tests.sglang_support import exact_mapping_env, hybrid_pool, mamba2_params

    exact_mapping_env(SimpleNamespace(setenv=os.environ.__setitem__), contiguous, host_mb=128)
    return hybrid_pool(mamba2_params(INTER, HEADS, HEAD_DIM, STATE, layers=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--cases", default="contiguous:bfloat16,per_layer:bfloat16",
                    help="LAYOUT:DTYPE,...: the layout of kvcached's states and the model's dtype (activations and "
                         "weights)")
    args = ap.parse_args()
    from tests.sglang_support import sglang_missing

    if (missing := sglang_missing()) is not None:
        print(json.dumps({"skip": missing}))
        return 0
    import sglang
    import torch
    import triton

    from kvcached.integration.sglang import interfaces, patches
    from tests.compile_only import compile_only

    patches.apply()
    # the state update enters torch.get_device_module(x.device).device(index), which torch.cpu lacks
    torch.cpu.device = lambda index: contextlib.nullcontext()
    results = []
    for case in args.cases.split(","):
        layout, dtype = case.split(":")
        result: dict = {"sglang": sglang.__version__, "triton": triton.__version__, "target": args.target,
                        "layout": layout, "dtype": dtype}
        pool = _pool(layout == "contiguous")
        try:
            with compile_only(args.target) as done:
                result["strides"] = _mixer_calls(pool, getattr(torch, dtype), layer=2)
            result["compiled"] = sorted(done.names())
        except Exception as exc:  # reported, not raised: the test reads which kernel failed and why
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["at"] = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        finally:
            interfaces.shutdown_kvcached()
        results.append(result)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
