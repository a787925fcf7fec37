"""Build a ``RunConfig`` from a YAML file, an optional DeepSpeed JSON, and command-line overrides.

Precedence: dataclass defaults < ``--config`` YAML < ``--deepspeed-config`` JSON (a whole DeepSpeed
config, read by ``config.deepspeed``; applied after the flags, skipping what they set) < flags. Every field can be set
as ``--<section>.<field> VALUE``; the common ones also have Megatron-style short flags
(``--tp``, ``--zero-stage``, ``--lr`` ...). Unknown keys are errors that name the key.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from zerotron.config import help as config_help
from zerotron.config import deepspeed
from zerotron.config.run_config import ConfigError, RunConfig
from zerotron.config.values import set_field

# short flag -> (section, field)
SHORT_FLAGS = {
    "tp": ("parallel", "tp"),
    "pp": ("parallel", "pp"),
    "cp": ("parallel", "cp"),  # Megatron's --context-parallel-size
    "sequence-parallel": ("parallel", "sequence_parallel"),
    "virtual-stages": ("parallel", "virtual_stages"),  # Megatron's --num-layers-per-virtual-pipeline-stage, by count
    "zero-stage": ("zero", "stage"),
    "precision": ("training", "precision"),
    "micro-batch-size": ("training", "micro_batch_size"),
    "global-batch-size": ("training", "global_batch_size"),
    "seq-length": ("model", "seq_length"),
    "train-steps": ("training", "train_steps"),
    "lr": ("optimizer", "lr"),
    "seed": ("training", "seed"),
    "compile": ("training", "compile"),
    "dropout": ("model", "dropout"),
    "checkpoint-activations": ("activation_checkpointing", "checkpoint_activations"),
    "partition-activations": ("activation_checkpointing", "partition_activations"),
    "cpu-offload-activations": ("activation_checkpointing", "cpu_checkpointing"),
    "recompute-granularity": ("activation_checkpointing", "recompute_granularity"),
    "offload-optimizer": ("zero", "offload_optimizer"),
    "run-dir": ("logging", "run_dir"),
    "save": ("checkpoint", "save"),
    "save-interval": ("checkpoint", "save_interval"),
    "load": ("checkpoint", "load"),
    "init-from-hf": ("checkpoint", "init_from_hf"),
    "log-interval": ("logging", "log_interval"),
    "eval-interval": ("logging", "eval_interval"),
    "wandb-mode": ("logging", "wandb_mode"),
}
BOOL_FLAGS = {"checkpoint-activations", "partition-activations", "cpu-offload-activations", "offload-optimizer",
              "sequence-parallel", "compile"}
OTHER_FLAGS = {"config": "--config", "deepspeed-config": "--deepspeed-config",
               "profile-steps": "logging.profile_steps"}  # what each flag of its own sets


def _setting(token: str) -> str | None:
    """What a command-line token sets (``section.field`` or the flag itself), None for a value."""
    if not token.startswith("--") or token == "--":
        return None
    name = token[2:].partition("=")[0]
    if name in SHORT_FLAGS:
        return ".".join(SHORT_FLAGS[name])
    if name in OTHER_FLAGS:
        return OTHER_FLAGS[name]
    section, dot, key = name.partition(".")
    return f"{section}.{key}".replace("-", "_") if dot else None


def _flags(argv: list[str]) -> list[tuple[str | None, list[str]]]:
    """``argv`` cut into ``(what it sets, its tokens)``: a flag with its value, or a lone token."""
    chunks: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(argv):
        what, token = _setting(argv[i]), argv[i]
        takes_value = (what is not None and "=" not in token and token[2:] not in BOOL_FLAGS
                       and i + 1 < len(argv))
        width = 3 if takes_value and token == "--profile-steps" else 2 if takes_value else 1
        chunks.append((what, argv[i:i + width]))
        i += width
    return chunks


def refuse_repeats(argv: list[str]) -> None:
    """A flag given twice (``--lr 0.5 --lr 0.001``) is refused naming it: argparse would let the
    last one win in silence, and the first may be the one the user meant (issue 46)."""
    seen: dict[str, list[str]] = {}  # what is set -> the tokens that first set it
    for what, tokens in _flags(argv):
        if what is None:
            continue
        if what not in seen:
            seen[what] = tokens
            continue
        first, flag = seen[what][0].partition("=")[0], tokens[0].partition("=")[0]
        if first != flag:  # two spellings of one field, e.g. --tp 4 --parallel.tp 2
            short, long_ = sorted((first, flag), key=lambda f: "." in f)
            raise ConfigError(f"{short} and {long_} both set {what}; give one of them")
        raise ConfigError(f"{flag} is given twice ({' '.join(seen[what])}, then "
                          f"{' '.join(tokens)}); the last would win in silence: give it once")


def last_wins(argv: list[str]) -> list[str]:
    """``argv`` with each setting kept only where it is last given: for callers that build a
    command line as a base plus overrides (tests, the drill). A user's repeat is refused."""
    chunks = _flags(list(argv))
    last = {what: i for i, (what, _) in enumerate(chunks) if what is not None}
    return [t for i, (what, tokens) in enumerate(chunks) if what is None or last[what] == i
            for t in tokens]


def apply_mapping(cfg: RunConfig, data: dict, source: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping of keys")
        for name, value in values.items():
            set_field(cfg, section, name, value)


def apply_deepspeed(cfg: RunConfig, path: str, flagged: set[str], world_size: int) -> list[str]:
    """Apply the DeepSpeed JSON at ``path`` with the one reader (``config.deepspeed``), after the
    YAML and the flags (``flagged``: the ``section.field`` names they set, which it leaves alone);
    returns the start-up lines. Errors name the file and the DeepSpeed key."""
    origins: dict[str, str] = {}
    try:
        lines = deepspeed.apply_deepspeed(deepspeed.load_json(path), cfg, set_field, flagged, world_size, origins)
    except ValueError as e:
        raise ConfigError(f"--deepspeed-config {path}: {e}") from None
    cfg.deepspeed_file, cfg.deepspeed_keys = path, origins  # validate() names these keys in its errors
    return lines


def build_parser(exit_codes: str = "") -> argparse.ArgumentParser:
    """The flags; --help lists every config field (``config_help``) and then ``exit_codes``."""
    # no abbreviations: "--train 5" must not quietly become --train-steps 5
    p = argparse.ArgumentParser(description="Pretrain a GPT with zerotron (TP x PP x ZeRO-DP).",
                                allow_abbrev=False,
                                epilog=config_help.epilog(exit_codes),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run config (see configs/)")
    p.add_argument("--deepspeed-config", help="a DeepSpeed config JSON: every key honoured, mapped, noted "
                   "at start-up or refused (docs/deepspeed.md); it wins over --config, flags win over it")
    for flag, (section, name) in SHORT_FLAGS.items():
        if flag in BOOL_FLAGS:
            p.add_argument(f"--{flag}", dest=f"{section}.{name}", action="store_const", const="true",
                           help=config_help.short_flag_help(section, name, switch=True))
        else:
            p.add_argument(f"--{flag}", dest=f"{section}.{name}", metavar="V",
                           help=config_help.short_flag_help(section, name))
    p.add_argument("--profile-steps", dest="logging.profile_steps", nargs=2, metavar=("A", "B"),
                   help="write a torch.profiler trace of steps A to B under <run_dir>/profile "
                        "(logging.profile_steps; Perfetto, TensorBoard; CUDA: a memory snapshot)")
    return p


class _NoDuplicates(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (YAML's own rule, which
    PyYAML does not enforce: the last one would win in silence), as the DeepSpeed reader does."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # a list or mapping as a key
                raise yaml.constructor.ConstructorError(None, None, f"a {type(key).__name__} is not a key; use a name",
                                                        key_node.start_mark) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice; keep one",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path):
    """A YAML file's data, read as ``yaml.safe_load`` would but refusing a key given twice
    (``yaml.YAMLError`` naming it): every reader of the project's configs goes through here."""
    return yaml.load(Path(path).read_text(), Loader=_NoDuplicates)


def parse_config(argv: list[str] | None = None, exit_codes: str = "", world_size: int | None = None) -> RunConfig:
    """Parse flags into a ``RunConfig`` (not yet validated against a world size). ``world_size``
    (default ``$WORLD_SIZE``, else 1) sizes a DeepSpeed JSON's batch triple."""
    parser = build_parser(exit_codes)
    refuse_repeats(list(sys.argv[1:] if argv is None else argv))
    args, rest = parser.parse_known_args(argv)
    cfg = RunConfig()
    if args.config:
        try:
            data = read_yaml(args.config)
        except FileNotFoundError:
            raise ConfigError(f"--config {args.config}: file not found") from None
        except (IsADirectoryError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config {args.config}: not a readable YAML file ({e})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {args.config}: invalid YAML ({e})") from None
        if data is None:  # an empty file (or only comments) is a mistake, not "all defaults"
            raise ConfigError(f"--config {args.config}: the file is empty (no sections); write the run's "
                              f"sections (see configs/tiny.yaml) or drop --config to run on the defaults")
        apply_mapping(cfg, data, args.config)
    flagged: set[str] = set()  # section.field set on the command line: a DeepSpeed JSON leaves them
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            set_field(cfg, *dest.split(".", 1), value)
            flagged.add(dest)
    i = 0
    while i < len(rest):  # generic --section.field VALUE (or --section.field=VALUE)
        token = rest[i]
        if not token.startswith("--") or "." not in token:
            raise ConfigError(f"unknown argument {token!r}; use --section.field VALUE or see --help")
        key, _, value = token[2:].partition("=")
        if not _:
            if i + 1 >= len(rest):
                raise ConfigError(f"{token} needs a value")
            value, i = rest[i + 1], i + 1
        section, name = key.split(".", 1)
        field = f"{section.replace('-', '_')}.{name.replace('-', '_')}"
        if getattr(args, field, None) is not None:  # e.g. --tp 4 --parallel.tp 2: neither may win in silence
            short = next(f for f, sn in SHORT_FLAGS.items() if ".".join(sn) == field)
            raise ConfigError(f"--{short} and --{key} both set {field}; give one of them")
        set_field(cfg, section.replace("-", "_"), name.replace("-", "_"), value)
        flagged.add(field)
        i += 1
    if cfg.checkpoint.init_from_hf:  # the directory's architecture replaces the preset
        from zerotron.config.hf_config import adopt_architecture, use_hf_tokenizer

        note = use_hf_tokenizer(cfg, adopt_architecture(cfg, flagged))
        if note and int(os.environ.get("RANK", 0)) == 0:
            print(f"[hf] {note}", flush=True)
    if args.deepspeed_config:
        world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
        lines = apply_deepspeed(cfg, args.deepspeed_config, flagged, world)
        if int(os.environ.get("RANK", 0)) == 0:  # once per run, before any process group
            for line in lines:
                print(f"[deepspeed] {line}", flush=True)
    return cfg
