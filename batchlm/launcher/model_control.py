"""tritonserver's model control mode, as its arguments choose it, and the serve commands' default."""

from __future__ import annotations


def model_control_mode(args: list[str] | tuple[str, ...]) -> str:
    """The model control mode that tritonserver arguments `args` choose: the last
    `--model-control-mode=M` or `--model-control-mode M`; "none" (tritonserver's default) where none
    does; "" for a flag left without its value."""
    mode = "none"
    for i, arg in enumerate(args):
        if arg.startswith("--model-control-mode="):
            mode = arg.split("=", 1)[1]
        elif arg == "--model-control-mode":
            mode = args[i + 1] if i + 1 < len(args) else ""
    return mode


def with_model_control(extra: list[str] | tuple[str, ...]) -> list[str]:
    """tritonserver arguments for the serve commands: `extra`, with explicit model control and every
    model loaded at start added where `extra` chooses no mode of its own (a mode chosen in `extra` is
    kept). The repository API that explicit control opens is restricted like every administrative API
    of a `TritonServer` (`TritonServer.restricted_apis`), so only the serve command, which holds the
    header, can unload models, as without explicit model control no client could."""
    extra = list(extra)
    if any(a == "--model-control-mode" or a.startswith("--model-control-mode=") for a in extra):
        return extra
    return ["--model-control-mode=explicit", "--load-model=*", *extra]
