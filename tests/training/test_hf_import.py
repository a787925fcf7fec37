"""A transformers model in through ``--init-from-hf`` at TP 2 x PP 2 and out through
``convert_checkpoint.py --hf``: every tensor back bit for bit, and refusals that name the fix.

Reference: the model directories themselves, built at random by ``transformers`` (no download,
fp32; ``hf_models.py``): Llama (GQA 3:1, Llama-3.1 rope scaling, untied, five safetensors shards),
Qwen2 (q/k/v biases, tied) and Mistral (untied), plus GPT-2. Each is imported at TP 2 x PP 2 x
DP 1 with ``--train-steps 0 --save`` (each rank reading only its slices), exported, and compared
tensor by tensor with ``torch.equal`` on the raw bits; transformers loads the export as the same
class and gives the directory's logits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.harness import spawn
from tests.training.hf_models import build

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import convert_checkpoint  # noqa: E402

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")


def build_all(root: str) -> dict[str, str]:
    return {f: build(f, f"{root}/{f}", seed=i, shard="100KB" if f == "llama" else None)
            for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    return spawn(build_all, 1, str(tmp_path_factory.mktemp("hf")), timeout=240)[0]


def import_and_save(dirs: dict, root: str, cache: str) -> list[str]:
    """Every family at TP 2 x PP 2: --init-from-hf DIR --train-steps 0 --save CKPT."""
    import torch.distributed as dist

    from tests.training.test_trainer import make_config
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    saved = []
    for family, directory in dirs.items():
        ck = f"{root}/{family}/ck"
        cfg = make_config(f"{root}/{family}", cache, "--init-from-hf", directory, "--tp", "2",
                          "--pp", "2", "--zero-stage", "1", "--train-steps", "0", "--save", ck)
        trainer = Trainer(build_run(cfg.validate(dist.get_world_size()), init_distributed()))
        trainer.train()
        saved.append(ck)
    return saved


def tensors(directory: str) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def export_and_compare(dirs: dict, checkpoints: list[str], root: str) -> dict:
    """convert_checkpoint.py --hf, then the tensors' bits and transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for (family, directory), ck in zip(dirs.items(), checkpoints):
        target = f"{root}/{family}-out"
        assert convert_checkpoint.main([ck, "--hf", target]) == 0
        want, got = tensors(directory), tensors(target)
        assert sorted(got) == sorted(want), f"{family}: names {set(got) ^ set(want)}"
        for name, t in want.items():
            assert got[name].dtype == t.dtype == torch.float32 and got[name].shape == t.shape
            assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), \
                f"{family}: {name} differs"
        ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
        models = [AutoModelForCausalLM.from_pretrained(d) for d in (directory, target)]
        classes = [type(m).__name__ for m in models]
        assert classes[0] == classes[1], f"{family}: exported as {classes[1]}, not {classes[0]}"
        with torch.no_grad():
            logits = [m(input_ids=ids).logits for m in models]
        assert torch.equal(logits[0], logits[1]), f"{family}: logits differ"
        out[family] = json.loads((Path(target) / "config.json").read_text())["architectures"]
    return out


def test_import_at_tp2_pp2_and_export_give_every_tensor_back_bit_for_bit(hf_dirs, zerotron_cache,
                                                                       tmp_path):
    checkpoints = spawn(import_and_save, 4, hf_dirs, str(tmp_path), zerotron_cache, timeout=300)[0]
    classes = spawn(export_and_compare, 1, hf_dirs, checkpoints, str(tmp_path), timeout=300)[0]
    assert classes == {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"],
                       "mistral": ["MistralForCausalLM"], "gpt2": ["GPT2LMHeadModel"]}


def broken_copies(dirs: dict, root: str) -> dict[str, str]:
    """Directories that must be refused, each one change away from a good one."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    def copy(src: str, name: str, **config) -> Path:
        out = Path(root) / name
        shutil.copytree(src, out)
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**raw, **config}))
        return out

    def rewrite(out: Path, change) -> None:
        weights = load_file(str(out / "model.safetensors"))
        change(weights)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    out = {"qwen3": copy(dirs["qwen2"], "qwen3", architectures=["Qwen3ForCausalLM"],
                         model_type="qwen3"),
           "window": copy(dirs["mistral"], "window", sliding_window=16),
           "yarn": copy(dirs["qwen2"], "yarn", rope_parameters={"rope_type": "yarn",
                                                                "rope_theta": 1e6, "factor": 4.0})}
    out["missing"] = copy(dirs["qwen2"], "missing")
    rewrite(out["missing"], lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    out["shape"] = copy(dirs["mistral"], "shape")
    key = "model.layers.0.mlp.down_proj.weight"
    rewrite(out["shape"], lambda w: w.update({key: w[key].t().contiguous()}))
    out["dtype"] = copy(dirs["mistral"], "dtype")
    rewrite(out["dtype"], lambda w: w.update({key: w[key].to(torch.int32)}))
    return {k: str(v) for k, v in out.items()}


def refusals(cases: dict, root: str, cache: str) -> dict:
    """pretrain_gpt.main on ranks 0 and 1 of 2 for each case: (exit code, message) per rank."""
    import contextlib
    import io

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import pretrain_gpt

    from zerotron.config.cli import last_wins

    out = {}
    for name, flags in cases.items():
        for rank in (0, 1):
            os.environ.update(RANK=str(rank), WORLD_SIZE="2")
            err = io.StringIO()
            argv = ["--config", str(Path(__file__).parents[2] / "configs" / "tiny.yaml"), "--tp",
                    "1", "--seq-length", "32", "--run-dir", f"{root}/{name}", "--data.cache_dir",
                    cache, "--wandb-mode", "disabled", *flags]
            argv = last_wins(argv)  # a case's --seq-length overrides the base's (a repeat is refused)
            with contextlib.redirect_stderr(err):
                code = pretrain_gpt.main(argv)
            out[(name, rank)] = (code, err.getvalue())
    return out


def test_refusals_name_the_field_both_values_and_what_we_build(hf_dirs, zerotron_cache,
                                                              tmp_path):
    bad = spawn(broken_copies, 1, hf_dirs, str(tmp_path), timeout=120)[0]
    hf = "--init-from-hf"
    cases = {
        "flag": ([hf, hf_dirs["llama"], "--model.hidden_size", "64"],
                 "model.hidden_size=64 on the command line, but .* gives 48"),
        "family": ([hf, bad["qwen3"]], "Qwen3ForCausalLM.* is not built; zerotron builds "
                                       "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
        "window": ([hf, bad["window"]], "sliding_window=16 is active at model.seq_length=32"),
        "rope": ([hf, bad["yarn"]], "rope type 'yarn' is not built"),
        "context": ([hf, hf_dirs["qwen2"], "--seq-length", "512"],
                    "model.seq_length=512 exceeds .*max_position_embeddings=256"),
        "missing": ([hf, bad["missing"]], r"tensor model.layers.1.mlp.up_proj.weight is missing"),
        "shape": ([hf, bad["shape"]], r"down_proj.weight is \[44, 48\], but config.json gives "
                                      r"\[48, 44\]"),
        "dtype": ([hf, bad["dtype"]], "down_proj.weight is I32"),
    }
    got = spawn(refusals, 1, {k: v[0] for k, v in cases.items()}, str(tmp_path), zerotron_cache,
                timeout=240)[0]
    import re
    for name, (_, pattern) in cases.items():
        for rank in (0, 1):
            code, message = got[(name, rank)]
            assert code == 2 and re.search(pattern, message), f"{name} rank {rank}: {message!r}"
