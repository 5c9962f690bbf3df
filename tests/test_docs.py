"""README.md and docs/*.md name only files, modules, functions and ops that exist (CPU only, no MPI).

What counts as a name:
- a repository path (`commfuse/p2p/workspace.py`, `launch/ab.sh`, `bench/results/<glob>`, brace lists
  `{a,b}` and `{1..4}` expanded), whose first folder is a top-level folder of the repository or a
  subpackage of commfuse (the docs write `cli/probe.py` for commfuse/cli/probe.py): it must exist
  under the repository root or under commfuse/, a glob must match something. A pytest id
  (`tests/test_p2p.py::test_x`) also names a test function, which the file must define;
- a relative markdown link target, `#anchor` stripped, from the page's folder;
- a dotted name starting with `commfuse.`: the longest importable prefix is imported, the rest must
  resolve as attributes; `torch.ops.commfuse.<op>` and `commfuse::<op>` must be ops `import commfuse`
  registers;
- in backticks, `module.attr...` whose first part is the name of a commfuse module or subpackage
  (`routes.plan`, `p2p.Workspace`): the chain must resolve from a module of that name;
- in backticks, a file name alone with a project file's extension (`epilogue.cuh`): a file of that
  name must exist somewhere in the repository.
Fenced blocks tagged bash/sh/python are code: their paths and `commfuse.` names are checked. Untagged
ones hold layouts, formulas, printed reports and the JSON schema, which name nothing, so they are
skipped. A URL, or a path followed by a `<placeholder>`, names nothing either.
"""
import ast
import dataclasses
import glob
import importlib
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "commfuse"


# Other projects' source files that docs/semantics.md cites for their layouts: their trees have a
# csrc/ folder too, so these read as repository paths.
FOREIGN_PATHS = {
    "csrc/apis/layout.hpp",                       # DeepGEMM
    "csrc/jit_kernels/impls/smxx_layout.hpp",     # DeepGEMM
    "csrc/utils/math.hpp",                        # DeepGEMM
    "csrc/utils/layout.hpp",                      # DeepGEMM
    "csrc/quantization/w8a8/cutlass/c3x/scaled_mm_blockwise_sm90_fp8_dispatch.cuh",  # vLLM
    "csrc/trtllm_allreduce_fusion.cu",            # FlashInfer
}

# commfuse/kernels/params.py generates this header for NVRTC at run time: it is never a file of the repository.
GENERATED_FILES = {importlib.import_module("commfuse.kernels.params").HEADER_NAME}

CODE_FENCES = {"bash", "sh", "shell", "python", "py"}
# `.h`, `.so`, `.json` names in the docs are the CUDA toolkit's, NCCL's, FlashInfer's or placeholders.
PROJECT_EXTENSIONS = ("py", "cu", "cuh", "cpp", "c", "sh", "md", "toml")


def _ignored_top_level():
    """Top-level folders .gitignore names (`/x/` or `x/`): build output and local state, not the project."""
    ignore = REPO / ".gitignore"
    lines = ignore.read_text().splitlines() if ignore.exists() else []
    return {m.group(1) for line in lines if (m := re.fullmatch(r"/?([\w.-]+)/", line.strip()))}


IGNORED = _ignored_top_level()


def _files_by_name():
    """{file name: paths} of the project's files: hidden, ignored and cache folders (CI's .venv) left out."""
    found = {}
    for folder, subfolders, names in os.walk(REPO):
        top = Path(folder) == REPO
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"
                         and not d.endswith(".egg-info") and not (top and d in IGNORED)]
        for n in names:
            found.setdefault(n, []).append(Path(folder) / n)
    return found


def _roots():
    top = {p.name for p in REPO.iterdir()
           if p.is_dir() and not p.name.startswith((".", "_")) and p.name not in IGNORED}
    return top | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def _modules():
    """{file or package name: [dotted module names]} for every module of commfuse."""
    found = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # importing it would run it
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.setdefault(parts[-1], []).append(".".join(parts))
    return found


ROOTS = _roots()
MODULES = _modules()
FILES_BY_NAME = _files_by_name()

URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"(?<![\w./~$<-])(?:\./)?((?:%s)/(?:[\w.*?/-]|\{[^{}\s]*\})*)" %
                  "|".join(sorted(map(re.escape, ROOTS), key=len, reverse=True)))
PYTEST_ID = re.compile(r"::(\w+)")
DOTTED = re.compile(r"(?<![\w.])commfuse(?:\.[A-Za-z_]\w*)+")
# `commfuse::name<...>` is a kernel template of csrc/ (the kernels' C++ namespace), not an op.
TORCH_OP = re.compile(r"(?:(?<![\w.])torch\.ops\.commfuse\.|(?<![\w:])commfuse::)([A-Za-z_]\w*)(?![\w<])")
MODULE_ATTR = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*)((?:\.[A-Za-z_]\w*)+)")
BARE_FILE = re.compile(r"[\w.-]+\.(?:%s)" % "|".join(PROJECT_EXTENSIONS))
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


@dataclasses.dataclass(frozen=True)
class Failure:
    where: str
    line: int
    name: str
    why: str

    def __str__(self):
        return f"{self.where}:{self.line}: {self.name}: {self.why}"


def _expand_braces(s):
    m = re.search(r"\{([^{}]*)\}", s)
    if not m:
        return [s]
    if rng := re.fullmatch(r"(\d+)\.\.(\d+)", m.group(1)):
        choices = [str(i) for i in range(int(rng.group(1)), int(rng.group(2)) + 1)]
    else:
        choices = m.group(1).split(",")
    return [e for c in choices for e in _expand_braces(s[:m.start()] + c + s[m.end():])]


def _existing(path):
    """The files or folders `path` (relative to the repository or to commfuse/, maybe a glob) names."""
    found = []
    for base in (REPO, PACKAGE):
        if any(ch in path for ch in "*?["):
            found += [Path(p) for p in glob.glob(str(base / path))]
        elif (base / path).exists():
            found.append(base / path)
    return found


def _missing_test(files, test):
    """Why none of `files` defines the test function `test`, or None."""
    for f in files:
        if f.is_file():
            tree = ast.parse(f.read_text())
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == test for n in ast.walk(tree)):
                return None
    return f"no test {test} in {', '.join(str(f.relative_to(REPO)) for f in files)}"


def _check_path(raw, after):
    """Why the path written as `raw`, followed by the text `after`, names nothing; None if it exists."""
    path = raw.rstrip(".,;:")
    if after.startswith("<") or path in FOREIGN_PATHS:
        return None
    expanded = _expand_braces(path)
    missing = [p for p in expanded if not _existing(p)]
    if missing:
        return "no such file or folder in the repository" + (f" ({', '.join(missing)})" if expanded != [path] else "")
    if test := PYTEST_ID.match(after):
        return _missing_test(_existing(path), test.group(1))
    return None


def _check_bare_file(span):
    name, _, test = span.partition("::")
    files = FILES_BY_NAME.get(name)
    if name in GENERATED_FILES:
        return None
    if not files:
        return "no file of that name in the repository"
    return _missing_test(files, test) if test else None


def _has_attr(obj, name):
    if hasattr(obj, name):
        return True
    # A dataclass field without a default, or an annotated attribute, is no class attribute.
    return isinstance(obj, type) and (
        (dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)})
        or any(name in getattr(c, "__annotations__", {}) for c in obj.__mro__))


def _resolve(dotted):
    """Why `dotted` (a module, then attributes) does not resolve, or None."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and not name.startswith(e.name):
                return f"importing {name} fails: {e}"  # a dependency is missing, not the module
            continue
        for attr in parts[n:]:
            if not _has_attr(obj, attr):
                return f"{name} has no attribute {attr}"
            if not hasattr(obj, attr):
                return None  # a declared field: what it holds is known only on an instance
            obj = getattr(obj, attr)
            name += "." + attr
        return None
    return f"no module {parts[0]}"


def _check_op(op):
    import torch
    import commfuse  # noqa: F401 - registers the ops

    try:
        getattr(torch.ops.commfuse, op)
    except AttributeError:
        return "no such op registered by commfuse"
    return None


def _check_module_attr(first, rest):
    candidates = MODULES.get(first)
    if not candidates:
        return None  # not a commfuse module: torch, FlashInfer, a variable
    whys = [_resolve(module + rest) for module in candidates]
    return None if None in whys else "; ".join(whys)


def check_markdown(text, where, folder):
    """Every name in `text` (a markdown page called `where`, its links relative to `folder`) that does not exist."""
    failures = []

    def fail(line, name, why):
        if why:
            failures.append(Failure(where, line, name, why))

    fence, tag = None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if m := FENCE.match(line):
            if fence is None:
                fence, tag = m.group(1), m.group(2).lower()
                continue
            if m.group(1).startswith(fence) and not m.group(2):
                fence = None
                continue
        in_code = fence is not None
        if in_code and tag not in CODE_FENCES:
            continue
        line = URL.sub(" ", line)
        for m in PATH.finditer(line):
            test = PYTEST_ID.match(line[m.end():])
            name = m.group(1).rstrip(".,;:") + (test.group(0) if test else "")
            fail(number, name, _check_path(m.group(1), line[m.end():]))
        for m in DOTTED.finditer(line):
            fail(number, m.group(0), _resolve(m.group(0)))
        for m in TORCH_OP.finditer(line):
            fail(number, m.group(0), _check_op(m.group(1)))
        if in_code:
            continue
        for m in LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if target and not re.match(r"[a-z][a-z0-9+.-]*:", target) and not (folder / target).exists():
                fail(number, m.group(1), "the link's target does not exist")
        for span in CODE_SPAN.findall(line):
            if BARE_FILE.fullmatch(span.split("::")[0]):
                fail(number, span, _check_bare_file(span))
                continue
            for m in MODULE_ATTR.finditer(span):
                if m.group(1) != "commfuse" and not BARE_FILE.fullmatch(m.group(0)):
                    fail(number, m.group(0), _check_module_attr(m.group(1), m.group(2)))
    return failures


def _pages():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_docs_name_only_what_exists():
    failures = []
    for page in _pages():
        failures += check_markdown(page.read_text(), page.relative_to(REPO).as_posix(), page.parent)
    assert not failures, "names in the docs that do not exist:\n" + "\n".join(map(str, failures))


def test_checker_reports_exactly_the_missing_names():
    page = (
        "The oracle is `commfuse.reference.fused_tail`, kept beside\n"
        "`commfuse/no_such_module.py`; ask `commfuse.reference.no_such_function` for the rest.\n"
    )
    failures = check_markdown(page, "docs/fake.md", REPO / "docs")
    assert [(f.line, f.name) for f in failures] == [
        (2, "commfuse/no_such_module.py"), (2, "commfuse.reference.no_such_function")], failures


def test_checker_leaves_what_names_nothing_alone():
    page = (
        "See https://github.com/org/repo/blob/main/docs/gone.md and `bench/results/<file>` or\n"
        "`bench-<machine>.json`; `COMMFUSE_CHECK=1`, `kQuantFp8`, `TailParams.residual_in`,\n"
        "`torch.distributed.all_reduce`, `x.pow(2)`, `cuda_fp16.h`, DeepGEMM's `csrc/apis/layout.hpp`,\n"
        "the kernel `commfuse::fused_tail<__nv_bfloat16, 2, 1>` and its generated `commfuse_params.cuh`.\n"
        "```\n"
        "commfuse.fusion.no_such_report: commfuse/no_such_output.py\n"
        "```\n"
    )
    assert check_markdown(page, "docs/fake.md", REPO / "docs") == []


def _python_blocks(text: str) -> list:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_usage_runs_as_written(tmp_path):
    """The README's usage blocks (the eager calls, then the same through commfuse.ops) run as one script in one
    process on the CPU, as a user pastes them; a name a later block reads from an earlier one must exist."""
    import subprocess
    import sys

    from processes import single_process_env

    blocks = _python_blocks((REPO / "README.md").read_text())
    first = next(i for i, b in enumerate(blocks) if "commfuse.init_distributed()" in b)
    assert "commfuse.ops.fused_all_reduce(comm" in blocks[first + 1]
    script = tmp_path / "example.py"
    # Each FP8 call's scale suits its format: the amax is the values' bound, so no code reaches the e4m3 limit.
    script.write_text(blocks[first] + blocks[first + 1]
                      + "assert r.quant.dtype == torch.float8_e4m3fn and r.quant.float().abs().max() < 448\n")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=single_process_env(CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "gloo + separated tail" in res.stdout, res.stdout
