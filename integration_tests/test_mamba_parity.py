"""One Mamba-2 mixer against transformers' own `NemotronHMamba2Mixer` (its PyTorch path), built at
random by transformers and its weights copied in: float32, the BF16 recipe (nothing quantized),
within the tolerance the dense parity tests use (max |diff| / max |out| <= 1e-5), with several
groups, a length that does not divide the chunk, and a dt clip; and the same mixer with packed
documents against each document alone through transformers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

import nvfp4_ops  # noqa: E402
from nvfp4_train.model.blocks.mamba import Mamba2Mixer  # noqa: E402
from nvfp4_train.model.blocks.mamba_config import MambaConfig  # noqa: E402
from nvfp4_train.model.config import ModelConfig  # noqa: E402

D_MODEL, HEADS, HEAD_DIM, STATE, GROUPS, CHUNK = 32, 16, 4, 8, 2, 16


def _hf_mixer(time_step_limit):
    from transformers import NemotronHConfig

    torch.manual_seed(0)
    config = NemotronHConfig(
        hidden_size=D_MODEL, layers_block_type=["mamba"], mamba_num_heads=HEADS,
        mamba_head_dim=HEAD_DIM, ssm_state_size=STATE, n_groups=GROUPS, conv_kernel=4,
        chunk_size=CHUNK, time_step_limit=time_step_limit, layer_norm_epsilon=1e-5,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
    )  # fmt: skip
    mixer = nemotron_h.NemotronHMamba2Mixer(config, layer_idx=0).float().eval()
    with torch.no_grad():  # random values everywhere (the init leaves D = 1, norm = 1)
        for name, p in mixer.named_parameters():
            if name in ("D", "norm.weight", "dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name != "dt_bias" else -1.0))
    return mixer


def _ours(mixer, time_step_limit) -> Mamba2Mixer:
    mamba = MambaConfig(num_heads=HEADS, head_dim=HEAD_DIM, state_dim=STATE, n_groups=GROUPS,
                        chunk_size=CHUNK, time_step_limit=time_step_limit)  # fmt: skip
    cfg = ModelConfig(vocab_size=64, d_model=D_MODEL, num_layers=1, num_heads=2, num_kv_heads=1,
                      mlp_dim=64, architecture="nemotron_h", pattern="M", mamba=mamba,
                      rope=False, dtype="float32", rms_norm_eps=1e-5)  # fmt: skip
    bf16 = nvfp4_ops.get_recipe("bf16")
    recipes = {"m.in_proj": bf16, "m.out_proj": bf16}
    ours = Mamba2Mixer(cfg, recipes, "m", rngs=nnx.Rngs(0), backend="emulated")
    w = {name: p.detach().numpy() for name, p in mixer.named_parameters()}
    ours.in_proj.kernel[...] = jnp.asarray(w["in_proj.weight"].T)
    ours.out_proj.kernel[...] = jnp.asarray(w["out_proj.weight"].T)
    ours.conv1d.kernel[...] = jnp.asarray(w["conv1d.weight"][:, 0, :].T)
    ours.conv1d.bias[...] = jnp.asarray(w["conv1d.bias"])
    for name in ("dt_bias", "A_log", "D"):
        getattr(ours, name)[...] = jnp.asarray(w[name])
    ours.norm.scale[...] = jnp.asarray(w["norm.weight"])
    return ours


@pytest.mark.parametrize(
    "time_step_limit", [(0.0, float("inf")), (0.05, 0.4)], ids=["no-clip", "clip"]
)
def test_mamba_mixer_matches_transformers(time_step_limit):
    mixer = _hf_mixer(time_step_limit)
    limit = () if time_step_limit[1] == float("inf") else time_step_limit
    ours = _ours(mixer, limit)
    x = np.random.default_rng(1).standard_normal((2, 37, D_MODEL)).astype(np.float32)
    with torch.no_grad():
        want = mixer(torch.from_numpy(x)).numpy()
    got = np.asarray(ours(jnp.asarray(x), (None, None)))
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_packed_documents_match_transformers_run_per_document():
    mixer = _hf_mixer((0.0, float("inf")))
    ours = _ours(mixer, ())
    x = np.random.default_rng(2).standard_normal((1, 40, D_MODEL)).astype(np.float32)
    segments = np.repeat([0, 1, 2], [13, 16, 11])[None]
    got = np.asarray(ours(jnp.asarray(x), (None, None), (jnp.asarray(segments), None)))
    with torch.no_grad():
        want = np.concatenate(
            [mixer(torch.from_numpy(x[:, segments[0] == d])).numpy() for d in range(3)], axis=1
        )
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
