"""flash-linear-attention checkpoints (gated_deltanet, delta_net) vs a reference built from fla's
naive ops. fla's layers need Triton and a GPU, so the checkpoint is written here with fla's
published parameter names (fla/layers/{gated_deltanet,delta_net}.py, fla/models/*) and config
keys, and the reference runs its separate q/k/v convs and fla's pure-PyTorch recurrences."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from edgemem.models import from_hf
from edgemem.models.hf.cache import from_external, to_external

VOCAB, D, LAYERS, EPS = 53, 32, 2, 1e-6


def _naive(op: str):
    """fla's pure-PyTorch reference module of `op`, loaded by path: importing the `fla.ops` package
    imports Triton, which a CPU install lacks; the naive files need only torch and einops."""
    path = Path(importlib.util.find_spec("fla").origin).parent / "ops" / op / "naive.py"
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


delta_rule_recurrence = _naive("delta_rule").delta_rule_recurrence
naive_recurrent_gated_delta_rule = _naive("gated_delta_rule").naive_recurrent_gated_delta_rule


def fla_checkpoint(path, model_type: str, **options) -> tuple[dict, dict[str, torch.Tensor]]:
    config = (
        dict(
            model_type=model_type,
            hidden_size=D,
            num_hidden_layers=LAYERS,
            vocab_size=VOCAB,
            norm_eps=EPS,
            hidden_ratio=4,
            intermediate_size=None,
            use_short_conv=True,
            conv_size=4,
            tie_word_embeddings=False,
            hidden_act="swish",
            attn=None,
        )
        | options
    )
    if model_type == "gated_deltanet":
        config = dict(head_dim=8, num_heads=2, expand_v=2.0, use_gate=True, allow_neg_eigval=False) | config
        hk, dk = config["num_heads"], config["head_dim"]
        hv = config.get("num_v_heads") or hk
        dv = int(dk * config["expand_v"])
    else:
        config = (
            dict(
                expand_k=1.0,
                expand_v=1.0,
                num_heads=4,
                use_gate=False,
                use_beta=True,
                qk_activation="silu",
                qk_norm="l2",
                allow_neg_eigval=False,
            )
            | config
        )
        hk = hv = config["num_heads"]
        dk, dv = int(D * config["expand_k"]) // hk, int(D * config["expand_v"]) // hv
    mlp = 256 * -(-int(D * 4 * 2 / 3) // 256)
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.2, offset=0.0):
        return torch.randn(shape, generator=g) * scale + offset

    w = {
        "model.embeddings.weight": rand(VOCAB, D),
        "model.norm.weight": rand(D, offset=1.0),
        "lm_head.weight": rand(VOCAB, D),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "attn_norm.weight": rand(D, offset=1.0),
            p + "mlp_norm.weight": rand(D, offset=1.0),
            p + "mlp.gate_proj.weight": rand(mlp, D),
            p + "mlp.up_proj.weight": rand(mlp, D),
            p + "mlp.down_proj.weight": rand(D, mlp, scale=0.05),
            p + "attn.q_proj.weight": rand(hk * dk, D),
            p + "attn.k_proj.weight": rand(hk * dk, D),
            p + "attn.v_proj.weight": rand(hv * dv, D),
            p + "attn.b_proj.weight": rand(hv, D),
            p + "attn.o_norm.weight": rand(dv, offset=1.0),
            p + "attn.o_proj.weight": rand(D, hv * dv),
        }
        if config["use_short_conv"]:
            for x, width in (("q", hk * dk), ("k", hk * dk), ("v", hv * dv)):
                w[p + f"attn.{x}_conv1d.weight"] = rand(width, 1, config["conv_size"], scale=0.5)
        if config["use_gate"]:
            w[p + "attn.g_proj.weight"] = rand(hv * dv, D)
        if model_type == "gated_deltanet":
            w |= {
                p + "attn.a_proj.weight": rand(hv, D),
                p + "attn.A_log": rand(hv, scale=0.5),
                p + "attn.dt_bias": rand(hv, scale=0.5),
            }
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(w, path / "model.safetensors")
    return config, w


def rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def reference(config, w, ids):
    """Logits, and per layer (q, k, v projection outputs, final state [B, H, K, V])."""
    b, t = ids.shape
    gated = config["model_type"] == "gated_deltanet"
    x = w["model.embeddings.weight"][ids]
    caches = []
    for i in range(LAYERS):
        p = f"model.layers.{i}.attn."
        h = rms(x, w[f"model.layers.{i}.attn_norm.weight"])
        raw = [h @ w[p + f"{n}_proj.weight"].T for n in "qkv"]
        if config["use_short_conv"]:
            k_size = config["conv_size"]
            q, k, v = (
                F.silu(
                    F.conv1d(r.transpose(1, 2), w[p + f"{n}_conv1d.weight"], padding=k_size - 1, groups=r.shape[-1])[
                        ..., :t
                    ].transpose(1, 2)
                )
                for r, n in zip(raw, "qkv")
            )
        else:
            q, k, v = (F.silu(r) for r in raw)
        hv = w[p + "b_proj.weight"].shape[0]
        dk, dv = w[p + "q_proj.weight"].shape[0] // config["num_heads"], v.shape[-1] // hv
        q, k = (l2(z.view(b, t, -1, dk)).repeat_interleave(hv // config["num_heads"], dim=2) for z in (q, k))
        v = v.view(b, t, hv, dv)
        beta = torch.sigmoid(h @ w[p + "b_proj.weight"].T) * (2 if config["allow_neg_eigval"] else 1)
        if gated:
            decay = -w[p + "A_log"].exp() * F.softplus(h @ w[p + "a_proj.weight"].T + w[p + "dt_bias"])
            o, state = naive_recurrent_gated_delta_rule(q, k, v, beta, decay, output_final_state=True)
        else:
            o, state = delta_rule_recurrence(*(z.transpose(1, 2) for z in (q, k, v, beta)))
            o = o.transpose(1, 2)
        o = rms(o, w[p + "o_norm.weight"])
        if config["use_gate"]:
            o = o * F.silu(h @ w[p + "g_proj.weight"].T).view(b, t, hv, dv)
        x = x + o.flatten(2) @ w[p + "o_proj.weight"].T
        m = f"model.layers.{i}.mlp"
        h = rms(x, w[f"model.layers.{i}.mlp_norm.weight"])
        x = (
            x
            + (F.silu(h @ w[m + ".gate_proj.weight"].T) * (h @ w[m + ".up_proj.weight"].T))
            @ w[m + ".down_proj.weight"].T
        )
        caches.append((raw, state))
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T, caches


CASES = {
    "gdn": ("gated_deltanet", {}),
    "gdn-gva-neg-eig": ("gated_deltanet", dict(num_v_heads=4, expand_v=1.5, allow_neg_eigval=True, conv_size=3)),
    "gdn-no-conv-no-gate": ("gated_deltanet", dict(use_short_conv=False, use_gate=False)),
    "deltanet": ("delta_net", {}),
    "deltanet-gate-expand": ("delta_net", dict(use_gate=True, expand_k=0.5, expand_v=2.0, num_heads=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_state_match_fla_naive_ops(tmp_path, case):
    model_type, options = CASES[case]
    config, w = fla_checkpoint(tmp_path, model_type, **options)
    model = from_hf(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, caches = reference(config, w, ids)
        logits, state = model.prefill(ids, model.init_state(2))
    assert float((logits - expected).abs().max() / expected.abs().max()) <= 1e-4
    # fla's cache layout: V-first recurrent state, conv caches holding the last K projected inputs of q, k, v
    layers = to_external(model, state, layout="fla")
    for layer, (raw, final) in zip(layers, caches):
        assert torch.allclose(layer["recurrent_state"], final.transpose(-1, -2), atol=1e-5)
        if config["use_short_conv"]:
            for ours, r in zip(layer["conv_state"], raw):
                assert torch.allclose(ours[..., 1:], r[:, -(config["conv_size"] - 1) :].transpose(1, 2), atol=1e-5)
    back = from_external(model, layers, layout="fla")
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("case", ["gdn-gva-neg-eig", "deltanet-gate-expand"])
def test_imported_model_follows_the_protocol_law_in_fp64(tmp_path, case):
    """prefill, steps and more prefill from the carried state reproduce forward (fp64 within 1e-9)."""
    model_type, options = CASES[case]
    fla_checkpoint(tmp_path, model_type, **options)
    model = from_hf(tmp_path).double()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(ids)
        state = model.init_state(2, dtype=torch.float64)
        a, state = model.prefill(ids[:, :3], state)
        rows = [a]
        for t in range(3, 5):
            row, state = model.step(ids[:, t], state)
            rows.append(row[:, None])
        b, _ = model.prefill(ids[:, 5:], state)
    assert float((torch.cat([*rows, b], 1) - whole).abs().max() / whole.abs().max()) <= 1e-9
