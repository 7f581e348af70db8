"""tensordict and megatron-core imported without torch's compiler stack, which they reach for while importing.

tensordict marks functions for Dynamo as it is imported (`torch.compiler.allow_in_graph`,
`assume_constant_result`), and megatron-core binds its fused elementwise functions with `torch.compile`
(megatron.core.jit's `jit_fuser`). Each imports torch._dynamo (megatron also torch._inductor): about 3 s of the
~6 s of imports a Megatron rank pays on a 2-core Xeon, and 2 s of a reward or environment worker's, in every
process of every run, though nothing compiles unless a strategy sets `use_torch_compile`.

`install()` (done by `import roll_backend`) puts a finder first on sys.meta_path that runs those imports with the
same effects, moved to when they are needed:
- tensordict: `assume_constant_result` sets the marker attribute Dynamo reads (all torch's version does);
  `allow_in_graph` registrations are kept and made the moment torch._dynamo is imported, by anything, so before
  anything can compile;
- megatron.core.jit: `jit_fuser` is `torch.compile` applied at a function's first call (torch.compile compiles
  at the first call anyway; only its import moves there).
A library imported before `install()` is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys

TESTED_TORCH_VERSIONS = ("2.13.",)  # where torch.compiler's two marks do what _marks_without_dynamo does
_graph_functions_waiting: list = []  # tensordict's allow_in_graph marks, until torch._dynamo is imported


def _allow_in_graph_later(fn):
    if "torch._dynamo" in sys.modules:
        import torch._dynamo

        return torch._dynamo.allow_in_graph(fn)
    _graph_functions_waiting.append(fn)
    return fn


def _assume_constant_result(fn):
    fn._dynamo_marked_constant = True
    return fn


@contextlib.contextmanager
def _marks_without_dynamo():
    import torch.compiler

    if not torch.__version__.startswith(TESTED_TORCH_VERSIONS):
        yield
        return
    saved = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
    torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = (
        _allow_in_graph_later,
        _assume_constant_result,
    )
    try:
        yield
    finally:
        torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = saved


@contextlib.contextmanager
def _then_register_waiting_marks():
    yield
    from torch._dynamo import allow_in_graph

    while _graph_functions_waiting:
        allow_in_graph(_graph_functions_waiting.pop())


def compile_on_first_call(model=None, **options):
    """`torch.compile` whose own import and set-up wait for the first call of what it wraps."""
    if model is None:  # used as @compile(...) with options
        return functools.partial(compile_on_first_call, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(model, **options)
        return compiled(*args, **kwargs)

    return call


@contextlib.contextmanager
def _compile_deferred():
    import torch

    saved = torch.compile
    torch.compile = compile_on_first_call
    try:
        yield
    finally:
        torch.compile = saved


_CONTEXT_BY_MODULE = {
    "tensordict": _marks_without_dynamo,
    "megatron.core.jit": _compile_deferred,
    "torch._dynamo": _then_register_waiting_marks,
}


class _ExecWithin(importlib.abc.Loader):
    """The module's own loader, executing it inside `context`; the module keeps its own loader afterwards."""

    def __init__(self, loader, context):
        self.loader, self.context = loader, context

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        with self.context():
            self.loader.exec_module(module)


class _DeferredCompileFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        context = _CONTEXT_BY_MODULE.get(fullname)
        if context is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ExecWithin(spec.loader, context)
                return spec
        return None


def install() -> None:
    """Idempotent; a no-op for a library already imported."""
    if not any(isinstance(finder, _DeferredCompileFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferredCompileFinder())
