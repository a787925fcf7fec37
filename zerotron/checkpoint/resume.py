"""Starting a run on a checkpoint directory: who owns it, which checkpoint continues the run, and
whether that checkpoint may continue it.

* **Ownership.** Rank 0 holds ``<logging.run_dir>/zerotron.lock`` and
  ``<checkpoint.save>/zerotron.lock`` (``run_lock.py``) for the whole run. A run's id is a
  fingerprint of its config apart from ``training.train_steps``, logging and
  how and where checkpoints are taken (``IGNORED``), so a restart of the same command -- ``torchrun
  --max-restarts`` -- is the same run, and a command that trains something else is another.
  Each checkpoint records the id; pruning deletes only its own run's.
* **Which checkpoint.** ``checkpoint.load=auto`` (the default) resumes the newest verified
  checkpoint of this run in ``checkpoint.save`` (same config apart from ``IGNORED``), and starts
  from scratch when there is none; an explicit directory resumes its newest verified checkpoint.
  Verified means its metadata reads and every shard's SHA-256 matches; the ranks share the
  hashing. A corrupt newest checkpoint is refused, naming it and the one before it, which is
  loaded only with ``checkpoint.fallback=true``.
* **May it continue.** As Megatron's ``check_checkpoint_args``: a learning-rate schedule, global
  batch or seed (``SCHEDULE``; ``training.train_steps`` where a decay ends there and the steps
  trained would change rate: ``resume_schedule``) that differs from the checkpoint's is refused
  unless ``checkpoint.override_schedule=true``, and a tokenizer that encodes otherwise than the
  checkpoint's (``check_tokenizer``) always; a checkpoint at or past ``training.train_steps`` means
  the run is complete (``AlreadyComplete``, exit 0). A run never writes over checkpoints it
  does not continue: a fresh start (or a load from elsewhere) into a directory that holds
  checkpoints is refused, and so is continuing where another run's checkpoints are newer.

Every decision is taken on every rank from the same files (a shared file system, as loading
already assumes) or broadcast from rank 0, so all ranks stop or go on together.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from zerotron.parallel.agreement import every_rank_reports
from zerotron.checkpoint.files import (LOAD_EARLIER, CheckpointError, check_checkpoint_path,
                                             complete_checkpoints, owner, read_metadata, resolve_load_path,
                                             sha256_file, step_of)
from zerotron.checkpoint.resume_schedule import (DECAY_END, SCHEDULE, decay_end, is_schedule,
                                              refusal, restretched)

# not part of what a run trains: its length, how it is logged, how and where its checkpoints are
# taken (a checkpoint directory copied or moved elsewhere still continues the same run)
IGNORED = ("training.train_steps", "training.skip_memory_check", "logging.*", "checkpoint.save",
           "checkpoint.load", "checkpoint.fallback", "checkpoint.override_schedule",
           "checkpoint.keep_last", "checkpoint.save_interval", "checkpoint.async_save")


class AlreadyComplete(Exception):
    """The checkpoint to resume is at or past ``training.train_steps``: there is nothing to train."""


@dataclass
class ResumePlan:
    path: Path | None = None  # None: start from scratch
    step: int = 0
    verified: frozenset = field(default_factory=frozenset)  # shard files already hashed
    consumed: int = 0  # samples the checkpoint had consumed: where the data continues


def flatten(config: dict) -> dict[str, Any]:
    """``{"section.field": value}`` of a run config dict, JSON-normalized (tuples become lists)."""
    plain = json.loads(json.dumps(config, default=str))
    return {f"{s}.{k}": v for s, sec in plain.items() if isinstance(sec, dict) for k, v in sec.items()}


def _ignored(key: str, ignore) -> bool:
    return key in ignore or f"{key.split('.')[0]}.*" in ignore


def run_id(cfg) -> str:
    flat = {k: v for k, v in flatten(cfg.to_dict()).items() if not _ignored(k, IGNORED)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:12]


def differences(saved: dict, ours: dict[str, Any], *, only=None, ignore=()) -> list[tuple[str, Any, Any]]:
    """``(field, checkpoint's value, this run's)`` for each field both configs have and that differs
    (a field newer than the checkpoint is not compared)."""
    old = flatten(saved or {})
    differ = {k: old[k] != v for k, v in ours.items() if k in old}
    if DECAY_END in differ:  # unset means train_steps (resume_schedule; both unset: restretched)
        either = old[DECAY_END] is not None or ours[DECAY_END] is not None
        differ[DECAY_END] = either and decay_end(old) != decay_end(ours)
    return [(k, old[k], v) for k, v in ours.items()
            if (only is None or k in only) and not _ignored(k, ignore) and differ.get(k)]


def _fields(diffs) -> str:
    return ", ".join(f"{k}={old!r} in the checkpoint, {new!r} in this run" for k, old, new in diffs)


# verification -------------------------------------------------------------------------------------
def verify(path: Path, grid, device) -> tuple[str | None, dict | None]:
    """``(problem or None, metadata)`` of checkpoint ``path``; each rank hashes every world_size-th shard."""
    try:
        meta = read_metadata(path)
        files = sorted(meta["files"])
        expected = [meta["files"][f]["sha256"] for f in files]
    except CheckpointError as e:
        return str(e), None
    except (KeyError, TypeError):
        return f"{path}/metadata.json does not list its shards' checksums", None
    if not files:
        return f"{path}/metadata.json lists no shards", None
    own = {i: 1 if not (path / files[i]).is_file() else 2 if sha256_file(path / files[i]) != expected[i] else 0
           for i in range(grid.rank, len(files), grid.world_size)}  # this rank's share of the hashing
    status = every_rank_reports(own, len(files), grid, device, "verify")
    bad = [(f, s) for f, s in zip(files, status) if s]
    if not bad:
        return None, meta
    text = "; ".join(f"shard {f} is " + ("missing" if s == 1 else "corrupt (its SHA-256 does not match "
                                         "metadata.json)") for f, s in bad[:3])
    return text + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""), meta


# the plan ---------------------------------------------------------------------------------------------
def _candidates(cfg, save: Path | None, ours: dict, log) -> tuple[list[Path], str]:
    """Checkpoints that could continue this run, newest first, and what ``checkpoint.load`` said."""
    c = cfg.checkpoint
    if c.load is None:
        return [], "checkpoint.load=none"
    if c.load == "auto":
        if save is None or not complete_checkpoints(save):
            if save is not None:
                log(f"[checkpoint] checkpoint.load=auto: {save} holds no checkpoint yet; starting from scratch")
            return [], "checkpoint.load=auto"
        ignore = IGNORED + (SCHEDULE if c.override_schedule else ())
        found = list(reversed(complete_checkpoints(save)))
        mine, other = [], None
        for p in found:
            try:
                diffs = differences(read_metadata(p).get("config", {}), ours, ignore=ignore)
            except CheckpointError:  # unreadable: cannot tell whose; verification names it below
                diffs = []
            if not diffs:
                mine.append(p)
            elif other is None:
                other = (p, diffs)
        if not mine and all(is_schedule(k) for k, _, _ in other[1]):
            asked = "checkpoint.load=auto"
            raise CheckpointError(refusal(asked, other[0], _fields(other[1]), None))
        if not mine:
            raise CheckpointError(
                f"checkpoint.load=auto: checkpoint.save={save} holds checkpoints of another run ({other[0].name}: "
                f"{_fields(other[1][:4])}); continue that run with --load {save} (its schedule is checked), or "
                f"give this run another checkpoint.save (or logging.run_dir)")
        for note in resolve_load_path(save)[1]:
            log(f"[checkpoint] {note}")
        return mine, "checkpoint.load=auto"
    path = check_checkpoint_path(c.load)
    if (path / "metadata.json").is_file():  # one checkpoint; the earlier ones beside it are the fallbacks
        step = step_of(path)
        earlier = [p for p in reversed(complete_checkpoints(path.parent)) if step is not None and step_of(p) < step]
        return [path, *earlier], f"checkpoint.load={c.load}"
    _, notes = resolve_load_path(path)  # raises naming checkpoint.load when there is nothing to load
    for note in notes:
        log(f"[checkpoint] {note}")
    return list(reversed(complete_checkpoints(path))), f"checkpoint.load={c.load}"


def _fresh_start(paths: list[Path], save: Path | None) -> str:
    """How to start from scratch instead of loading ``paths``: a fresh run refuses to write over
    checkpoints in its own ``checkpoint.save``, so those must go; elsewhere ``--load none`` does."""
    if save is not None and all(p.resolve().parent == save.resolve() for p in paths):
        return f"remove {', '.join(str(p) for p in paths)} to start from scratch"
    return "pass --load none to start from scratch"


def _corrupt(path: Path, problem: str, before: list[Path], grid, device, save: Path | None) -> str:
    """The refusal of a damaged checkpoint, with a fix that works from where it lies."""
    head = f"checkpoint {path} is corrupt: {problem.removesuffix(LOAD_EARLIER)}. "
    if not before:
        return head + (f"There is no checkpoint before it: {_fresh_start([path], save)}, or set checkpoint.load "
                       f"to another checkpoint")
    prev_problem, _ = verify(before[0], grid, device)
    state = "is intact (verified)" if prev_problem is None else f"is corrupt too ({prev_problem})"
    return head + (f"The one before it, {before[0]}, {state}: pass --checkpoint.fallback true to load "
                   f"{'it' if prev_problem is None else 'the newest intact earlier one'} (the steps after it "
                   f"are trained again), or repair or remove {path.name}")


def plan_resume(cfg, grid, device, log: Callable[[str], None] = print) -> ResumePlan:
    """Which checkpoint this run continues from (verified), or none; raises ``CheckpointError`` with
    the field and the fix, or ``AlreadyComplete``. Collective: call on every rank."""
    c = cfg.checkpoint
    ours = flatten(cfg.to_dict())
    save = Path(c.save) if c.save else None
    rid = run_id(cfg)
    candidates, asked = _candidates(cfg, save, ours, log)
    chosen, meta, skipped = None, None, []
    for i, path in enumerate(candidates):
        problem, meta = verify(path, grid, device)
        if problem is None:
            chosen = path
            break
        if not c.fallback:
            raise CheckpointError(f"{asked}: " + _corrupt(path, problem, candidates[i + 1:], grid, device, save))
        log(f"[checkpoint] {path} is corrupt ({problem.removesuffix(LOAD_EARLIER)}); checkpoint.fallback=true: "
            f"trying the one before it")
        skipped.append(path)
    if candidates and chosen is None:
        raise CheckpointError(f"{asked}: no intact checkpoint: {', '.join(str(p) for p in candidates)} are all "
                              f"corrupt; set checkpoint.load to another checkpoint, or "
                              f"{_fresh_start(candidates, save)}")
    step = int(meta["step"]) if chosen is not None else 0
    if chosen is not None and cfg.training.train_steps <= step:
        o = cfg.optimizer  # a decay ending at train_steps: a longer run resumes along it only so
        decay = o.schedule_steps is None and o.decay != "constant" and o.schedule != "onecycle"
        ended = flatten(meta.get("config", {})).get("training.train_steps")
        keep = f" (with --optimizer.schedule_steps {ended} to keep its decay)" if decay else ""
        raise AlreadyComplete(f"the run is already complete at step {step} ({chosen}; "
                              f"training.train_steps={cfg.training.train_steps}): nothing to "
                              f"train; raise training.train_steps to go on{keep}")
    if chosen is not None:
        diffs = differences(meta.get("config", {}), ours, only=SCHEDULE)
        stretch = restretched(meta, flatten(meta.get("config", {})), cfg)
        diffs += [stretch[0]] if stretch else []
        if diffs and not c.override_schedule:
            keep = (stretch[0][1], stretch[1]) if stretch else None
            raise CheckpointError(refusal(asked, chosen, _fields(diffs), keep))
        if diffs:
            log(f"[checkpoint] checkpoint.override_schedule=true: continuing with {_fields(diffs)}")
    if save is not None:
        _check_save_dir(save, chosen, step, rid, skipped, asked, log)
    files = frozenset(meta["files"]) if chosen is not None else frozenset()
    consumed = int(meta["consumed_samples"]) if chosen is not None else 0
    return ResumePlan(chosen, step, files, consumed)


def check_tokenizer(path: Path, tokenizer: str | None, cfg) -> None:
    """A checkpoint continues only with a tokenizer that encodes as its own did: another one's ids
    name other tokens to its embedding, which trains on in silence. Compared by
    ``encoding_digest`` against the copy the checkpoint keeps (two builds of the built-in corpus's
    tokenizer differ in their bytes, not in how they encode); one without a copy is not checked."""
    from zerotron.data.tokenizer import encoding_digest, tokenizer_sha256

    meta = read_metadata(path)
    kept = meta.get("tokenizer")
    copy = path / kept["file"] if kept else None
    if copy is not None and copy.exists() and tokenizer_sha256(copy) != kept["sha256"]:
        raise CheckpointError(f"checkpoint {path}: its tokenizer copy {copy} does not match the "
                              f"SHA-256 in metadata.json" + LOAD_EARLIER)
    if not tokenizer or copy is None or not copy.exists() or encoding_digest(tokenizer) == encoding_digest(copy):
        return
    what = (f"the tokenizer at {tokenizer} has changed since" if Path(kept["path"]) == Path(tokenizer).resolve()
            else f"this run's tokenizer, {tokenizer}, encodes otherwise than {kept['path']}, the one it had when")
    head = (f"checkpoint {path} was trained with another tokenizer: {what} the checkpoint was written; its "
            f"token ids would mean other tokens to the checkpoint's embedding")
    theirs = meta.get("config", {}).get("data", {}).get("default_corpus_vocab")
    if cfg.data.data_path or cfg.data.tokenizer:  # token files, or the built-in corpus encoded with it
        how = "train on token files made" if cfg.data.data_path else "encode the built-in corpus"
        fix = f"{how} with the checkpoint's own copy: --data.tokenizer {copy} --load {path}"
    elif theirs is not None and theirs != cfg.data.default_corpus_vocab:
        fix = f"set data.default_corpus_vocab={theirs}, the checkpoint's, with --load {path}"
    else:
        fix = (f"this zerotron's built-in corpus is not the one it trained on: pass token files made with its "
               f"tokenizer as data.data_path, with --data.tokenizer {copy} --load {path}")
    fresh = "--load none" + (" with another checkpoint.save" if cfg.checkpoint.save else "")
    raise CheckpointError(f"{head}; {fix}, or start from scratch: {fresh}")


def _check_save_dir(save: Path, chosen: Path | None, step: int, rid: str, skipped: list[Path], asked: str,
                    log) -> None:
    """Refuse to write over checkpoints this run does not continue; note this run's newer ones."""
    existing = [p for p in complete_checkpoints(save) if p not in skipped]
    continuing = chosen is not None and chosen.resolve().parent == save.resolve()
    if not continuing and existing:
        own = sum(owner(p) == rid for p in existing)
        whose = "this run's" if own == len(existing) else "another run's" if not own else "this and other runs'"
        source = f"loads {chosen} from elsewhere" if chosen is not None else "starts from scratch"
        fix = "continue it with --load auto" if own else f"continue that run with --load {save}"
        raise CheckpointError(
            f"{asked}: checkpoint.save={save} already holds {whose} checkpoints (newest {existing[-1].name}) and "
            f"this run {source}, so it would write over them: {fix}, or give this run another checkpoint.save "
            f"(or remove them)")
    newer = [p for p in existing if step_of(p) > step]
    foreign = [p for p in newer if owner(p) != rid]
    if foreign:
        raise CheckpointError(
            f"{asked}: checkpoint.save={save} holds {', '.join(p.name for p in foreign)} of another run, newer "
            f"than the loaded step {step}; this run would replace them: load the newest, or give this run "
            f"another checkpoint.save")
    if newer:
        log(f"[checkpoint] {', '.join(p.name for p in newer)} of this run are newer than step {step}; they stay, "
            f"and each is replaced when this run saves that step again")
