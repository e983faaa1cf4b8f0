"""train-bench's --codecs names: for each, the training script's options
(examples/data_parallel.py's) and the name the script reports it trained
with. A lossy codec's name with -noef appended runs it without error
feedback (int8-noef, sharded-int8-noef, fully-int8-noef).
"""

from __future__ import annotations

import re

_NO_FEEDBACK = "-noef"


def topk_name(name: str) -> bool:
    """topk<fraction>, the fraction in (0, 1]."""
    m = re.fullmatch(r"topk(\d*\.?\d+(?:e-?\d+)?)", name)
    return bool(m) and 0 < float(m.group(1)) <= 1


def codec_args(codec: str) -> tuple[list[str], str] | None:
    """The training script's options for a --codecs name, and the name the
    script reports it trained with (examples/data_parallel.py's
    compression_name); None if the name is unknown."""
    if codec.endswith(_NO_FEEDBACK):
        base = codec_args(codec[:-len(_NO_FEEDBACK)])
        if base is None or "--no-error-feedback" in base[0] or not _lossy_compression(base[0]):
            return None
        return base[0] + ["--no-error-feedback"], base[1] + _NO_FEEDBACK
    from herring_jax._src.collectives import codecs as codecs_lib
    if codec in codecs_lib.CODECS:
        return ["--compression", codec], codec
    m = re.fullmatch(rf"sharded(?:-({'|'.join(codecs_lib.CODECS[1:])}))?", codec)
    if m:
        # herring_jax.sharded_optimizer in place of allreduce_gradients.
        return ["--sharded-optimizer", "--compression", m.group(1) or "none"], codec
    m = re.fullmatch(rf"fully(-reshard)?(?:-({'|'.join(codecs_lib.CODECS[1:])}))?", codec)
    if m:
        # herring_jax.fully_sharded: parameters and state at 1/N.
        how = ["--fully-sharded", "--compression", m.group(2) or "none"]
        return how + (["--reshard-after-forward"] if m.group(1) else []), codec
    if topk_name(codec):
        fraction = codec[len("topk"):]
        return ["--topk-fraction", fraction], f"topk{float(fraction):g}"
    local = local_sgd_args(codec)
    if local:
        return local
    lossy = "|".join(c for c in codecs_lib.CODECS if c != "none")
    m = re.fullmatch(rf"powersgd([1-9]\d*)(?:-({lossy}))?(?:-it([1-9]\d*))?", codec)
    if m is None:
        return None
    rank, factor_codec, iterations = m.group(1), m.group(2), int(m.group(3) or 1)
    how, name = ["--powersgd-rank", rank], f"powersgd{rank}"
    # Only what differs from the defaults, so that a script that knows
    # --powersgd-rank alone still runs plain PowerSGD.
    if factor_codec:
        how += ["--powersgd-codec", factor_codec]
        name += f"-{factor_codec}"
    if iterations != 1:
        how += ["--powersgd-iterations", str(iterations)]
        name += f"-it{iterations}"
    return how, name


def local_sgd_args(codec: str) -> tuple[list[str], str] | None:
    """compute: no reduction at all (--reduce none, every process alone: the
    compute-only step); localsgd<H>, slowmo<H>, diloco<H>[f<F>][d<D>][-<codec>]:
    the script's --local-steps H --outer ... [--fragments F] [--delay D]
    (herring_jax.local_sgd and its presets, the pseudo-gradients sent with
    that codec)."""
    from herring_jax._src.collectives import codecs as codecs_lib
    if codec == "compute":
        return ["--reduce", "none"], codec
    lossy = "|".join(c for c in codecs_lib.CODECS if c != "none")
    m = re.fullmatch(rf"(localsgd|slowmo|diloco)([1-9]\d*)(?:f([1-9]\d*))?(?:d([1-9]\d*))?"
                     rf"(?:-({lossy}))?", codec)
    if m is None:
        return None
    outer = "sgd" if m.group(1) == "localsgd" else m.group(1)
    # f<F>, d<D>: Streaming DiLoCo's fragments and delay (--fragments, --delay).
    streaming = (["--fragments", m.group(3)] if m.group(3) else []) + (
        ["--delay", m.group(4)] if m.group(4) else [])
    return (["--local-steps", m.group(2), "--outer", outer, "--compression",
             m.group(5) or "none", *streaming], codec)




def _lossy_compression(options: list[str]) -> bool:
    """Whether a script's options name a lossy --compression (the wire codec
    whose error feedback -noef turns off)."""
    return any(a == "--compression" and b != "none" for a, b in zip(options, options[1:]))
