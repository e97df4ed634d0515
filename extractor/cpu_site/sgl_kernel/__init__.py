"""The CPU stand-in for ``sgl_kernel`` as an importable package, for processes SGLang spawns itself.

``extractor.cpu_shims.install_cpu_shims`` puts the stand-in into ``sys.modules`` of the process that
calls it. ``sglang.Engine`` runs its scheduler in processes it spawns, which import ``sgl_kernel``
afresh; ``extractor.generator`` puts this directory's parent first on their ``PYTHONPATH`` (only on
CPU, and only when no real sgl-kernel is installed), so they get the same stand-in.
"""

from extractor.cpu_shims import _build_shim_module as _build

_shim = _build()
assign_req_to_token_pool_cpu = _shim.assign_req_to_token_pool_cpu
__getattr__ = _shim.__getattr__  # PEP 562: every other op raises NotImplementedError when called
