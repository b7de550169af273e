"""`selfsup export` and the `selfsup-export` flow share `run_export`: a finished run's model in
a format other tools read (`selfsup_model.serving.hf_export`, `selfsup_model.serving.onnx_export`).
No Prefect import here: the command line exports without a Prefect server."""

from __future__ import annotations

import logging
import time
import typing
from pathlib import Path
from typing import Literal

from selfsup_model.errors import UserError

log = logging.getLogger("selfsup.export")
ExportFormat = Literal["hf", "onnx"]
FORMATS: tuple[str, ...] = typing.get_args(ExportFormat)


def run_export(workdir: str, export_format: str, out: str) -> dict:
    """Export and say what was written: {format, out, files, bytes, seconds}."""
    if export_format not in FORMATS:
        raise UserError(f"unknown export format {export_format!r}; choose one of "
                        f"{', '.join(FORMATS)}")
    start = time.perf_counter()
    if export_format == "hf":
        from selfsup_model.serving.hf_export import export_hf

        result = export_hf(workdir, out)
        paths = sorted(result.out.iterdir())
        what = f"{result.architecture} checkpoint"
    else:
        from selfsup_model.serving.onnx_export import export_onnx

        paths = export_onnx(workdir, out)
        what = "ONNX classifier"
    seconds = time.perf_counter() - start
    size = sum(Path(p).stat().st_size for p in paths)
    log.info("exported the %s of %s to %s: %d files, %.1f MB in %.1f s", what, workdir, out,
             len(paths), size / 1e6, seconds)
    return {"format": export_format, "out": str(out), "what": what,
            "files": [str(p) for p in paths], "bytes": size, "seconds": round(seconds, 3)}
