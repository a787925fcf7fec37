"""A Hugging Face model directory's ``config.json`` as zerotron's architecture fields.

``--init-from-hf DIR`` continues pretraining a ``transformers`` model: its architecture takes the
place of the preset, what is not architecture (sequence length, dropout) stays the run's. The
file is untrusted input, so every field read is checked here, on every rank, before any process
group: a family or feature we do not build is refused naming what we build, and a flag that
disagrees with the file is refused naming both values (neither may win in silence).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from zerotron.config.run_config import ConfigError, RunConfig

FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "GPT2LMHeadModel": "gpt2"}
WE_BUILD = ", ".join(FAMILIES)
FIELD = "checkpoint.init_from_hf"


@dataclass
class HFModel:
    """What ``config.json`` says: the family (its ``model_type``), the class, zerotron's fields."""

    directory: Path
    model_type: str
    architecture: str
    fields: dict  # GPTConfig field -> value
    raw: dict  # config.json as read


def _refuse(directory, what: str) -> ConfigError:
    return ConfigError(f"{FIELD}={directory}: {what}")


def _int(raw: dict, key: str, directory, default=None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(directory, f"config.json field {key}={value!r} must be a positive integer")
    return value


def _float(raw: dict, key: str, directory, default=None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise _refuse(directory, f"config.json field {key}={value!r} must be a finite number > 0")
    return float(value)


def _rope(raw: dict, directory) -> dict:
    """RoPE's base and Llama-3.1 scaling from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling``; other rope types are refused."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise _refuse(directory, "config.json rope_parameters / rope_scaling must be objects")
    params = {**scaling, **params}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = _float({**raw, **params}, "rope_theta", directory, 10000.0)
    fields = {"position_embedding_type": "rope", "rotary_base": theta, "rope_scaling": False}
    if kind == "llama3":
        fields.update(rope_scaling=True,
                      rope_scaling_factor=_float(params, "factor", directory),
                      rope_scaling_low_freq_factor=_float(params, "low_freq_factor", directory),
                      rope_scaling_high_freq_factor=_float(params, "high_freq_factor", directory),
                      rope_scaling_original_max_position_embeddings=_int(
                          params, "original_max_position_embeddings", directory))
    elif kind != "default":
        raise _refuse(directory, f"rope type {kind!r} is not built; zerotron builds RoPE's "
                                 f"'default' and Llama-3.1's 'llama3' scaling")
    return fields


def _llama_family(raw: dict, model_type: str, directory) -> dict:
    heads = _int(raw, "num_attention_heads", directory)
    hidden = _int(raw, "hidden_size", directory)
    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse(directory, f"hidden_act={raw.get('hidden_act')!r}: zerotron builds SwiGLU "
                                 f"(silu) for {model_type}")
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise _refuse(directory, f"head_dim={head_dim} differs from hidden_size/num_attention_heads"
                                 f"={hidden // heads}; zerotron builds heads of hidden_size/heads")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise _refuse(directory, f"{key}=true is not built for {model_type}; zerotron builds "
                                     f"q/k/v biases for Qwen2 only")
    if raw.get("pretraining_tp", 1) != 1:
        raise _refuse(directory, f"pretraining_tp={raw['pretraining_tp']}: only 1 is built")
    fields = {"num_layers": _int(raw, "num_hidden_layers", directory), "hidden_size": hidden,
              "num_heads": heads,
              "num_query_groups": _int(raw, "num_key_value_heads", directory, heads),
              "ffn_hidden_size": _int(raw, "intermediate_size", directory),
              "layernorm_eps": _float(raw, "rms_norm_eps", directory, 1e-6),
              "max_position_embeddings": _int(raw, "max_position_embeddings", directory),
              "normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False,
              "add_qkv_bias": model_type == "qwen2", "qk_layernorm": False,
              "untie_embeddings_and_output_weights": not raw.get("tie_word_embeddings", False),
              **_rope(raw, directory)}
    return fields


def _gpt2(raw: dict, directory) -> dict:
    act = raw.get("activation_function", "gelu_new")
    approx = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
    if act not in approx:
        raise _refuse(directory, f"activation_function={act!r}: zerotron builds GPT-2 with "
                                 f"{', '.join(approx)}")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                "add_cross_attention"):
        if raw.get(key):
            raise _refuse(directory, f"{key}=true is not built; zerotron builds plain GPT-2")
    if raw.get("scale_attn_weights", True) is not True or not raw.get("tie_word_embeddings", True):
        raise _refuse(directory, "scale_attn_weights=false or untied embeddings are not built for "
                                 "GPT-2; zerotron builds GPT-2 as released")
    hidden = _int(raw, "n_embd", directory)
    inner = raw.get("n_inner")
    return {"num_layers": _int(raw, "n_layer", directory), "hidden_size": hidden,
            "num_heads": _int(raw, "n_head", directory), "num_query_groups": None,
            "ffn_hidden_size": 4 * hidden if inner is None else _int(raw, "n_inner", directory),
            "layernorm_eps": _float(raw, "layer_norm_epsilon", directory, 1e-5),
            "max_position_embeddings": _int(raw, "n_positions", directory),
            "gelu_approximate": approx[act], "position_embedding_type": "learned",
            "normalization": "LayerNorm", "activation": "gelu", "add_bias_linear": True,
            "add_qkv_bias": False, "qk_layernorm": False, "rope_scaling": False,
            "untie_embeddings_and_output_weights": False}


def read_hf_config(directory: str, seq_length: int | None = None) -> HFModel:
    """``DIR/config.json`` checked and turned into ``GPTConfig`` fields; ``seq_length`` (the run's)
    decides whether a sliding window would be active (refused: we build full causal attention)."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise _refuse(directory, "no config.json there; give a transformers model directory "
                                 "(config.json + model.safetensors)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(directory, f"config.json is not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _refuse(directory, "config.json is not a JSON object")
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    if arch not in FAMILIES:
        raise _refuse(directory, f"architectures={archs!r} is not built; zerotron builds "
                                 f"{WE_BUILD}")
    model_type = FAMILIES[arch]
    if raw.get("model_type", model_type) != model_type:
        raise _refuse(directory, f"model_type={raw.get('model_type')!r} does not match "
                                 f"architectures={archs!r} ({model_type})")
    window = raw.get("sliding_window")
    layers = raw.get("layer_types") or []
    sliding = window is not None and (raw.get("use_sliding_window", model_type == "mistral")
                                      or "sliding_attention" in layers)
    if sliding and (seq_length is None or window < seq_length):
        raise _refuse(directory, f"sliding_window={window} is active at model.seq_length="
                                 f"{seq_length}; zerotron builds full causal attention: use a "
                                 f"seq_length <= {window}")
    fields = _gpt2(raw, directory) if model_type == "gpt2" else _llama_family(raw, model_type,
                                                                                directory)
    fields["vocab_size"] = _int(raw, "vocab_size", directory)
    return HFModel(Path(directory), model_type, arch, fields, raw)


def adopt_architecture(cfg: RunConfig, flagged: set[str]) -> HFModel:
    """Put ``checkpoint.init_from_hf``'s architecture into ``cfg.model`` in place of the preset's.

    ``flagged``: the ``section.field`` names the command line set. A flagged architecture field
    that disagrees with config.json is refused naming both values; the config file's own model
    fields are replaced (the directory is the model). The sequence length stays the run's, and
    must fit the model's context.
    """
    from zerotron.model.presets import PRESETS

    directory = cfg.checkpoint.init_from_hf
    seq = cfg.model.seq_length
    if seq is None and cfg.model.preset in PRESETS:
        seq = PRESETS[cfg.model.preset].seq_length
    hf = read_hf_config(directory, seq)
    for name, value in hf.fields.items():
        given = getattr(cfg.model, name)
        if f"model.{name}" in flagged and given is not None and given != value:
            raise ConfigError(f"model.{name}={given!r} on the command line, but {directory}/"
                              f"config.json gives {value!r} ({hf.architecture}); drop the flag: "
                              f"checkpoint.init_from_hf takes the architecture from the directory")
        setattr(cfg.model, name, value)
    limit = hf.fields["max_position_embeddings"]
    if seq is not None and seq > limit:
        raise ConfigError(f"model.seq_length={seq} exceeds {directory}'s context "
                          f"(max_position_embeddings={limit} in config.json); use "
                          f"--seq-length {limit} or less")
    return hf


def use_hf_tokenizer(cfg: RunConfig, hf: HFModel) -> str | None:
    """The one place that makes the model directory the run's tokenizer (issue 43, part B).

    Its ``tokenizer.json`` becomes ``data.tokenizer`` unless the user named one: the ids the
    model was trained on are that tokenizer's, and the built-in corpus (no ``data.data_path``) is
    then encoded with it. Returns the note the start-up prints, None when nothing to say.
    """
    from zerotron.data.hf_tokenizer import is_hf_dir

    if cfg.data.tokenizer:
        return None
    if not is_hf_dir(hf.directory):
        return (f"{hf.directory} holds no tokenizer.json; the run tokenizes with the built-in "
                f"corpus's tokenizer, whose ids are not the ones the model learnt: set "
                f"data.tokenizer to the model's tokenizer directory")
    cfg.data.tokenizer = str(hf.directory)
    corpus = "" if cfg.data.data_path else "; the built-in corpus is encoded with it"
    return f"data.tokenizer={hf.directory} (the model's tokenizer.json){corpus}"
