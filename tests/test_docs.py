"""README.md and docs/*.md cite only what exists: metric, rule and alert names, `x-kvgate-*`
headers, `KVGATE_*` variables, endpoints and their methods, files and links, `make` targets,
the flags of the `kvgate` commands and `python -m` modules they show, the code they name
(`module.function`, `Class.method`), and every panel of the Grafana dashboard. Read from the
sources (no process started): a rename in the code fails here until the docs follow it.
tests/test_cli.py holds the rest (docs/cli.md is the parsers' --help, one-line README commands)."""

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

from gateway.cli import COMMANDS, parser_of

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PRODUCT = ("gateway", "workers", "policies")  # where metrics, headers and routes are defined
CODE = (*PRODUCT, "bench")  # where code the docs name may live


def doc_id(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def prose(doc: Path) -> str:
    """The document without its fenced code blocks."""
    return re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)


def spans(doc: Path) -> list[str]:
    """Inline code spans (a span may wrap over lines: joined by a space) and fenced blocks."""
    text = doc.read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    inline = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose(doc))]
    return blocks + inline


def expand(name: str) -> list[str]:
    """`a_{x,y}_b` -> `a_x_b`, `a_y_b` (nested or repeated braces too)."""
    m = re.match(r"(.*?)\{([^{}]*)\}(.*)", name)
    if not m:
        return [name]
    return [e for part in m.group(2).split(",") for e in expand(m.group(1) + part + m.group(3))]


@cache
def sources(packages: tuple[str, ...] = PRODUCT) -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


@cache
def constants(packages: tuple[str, ...] = PRODUCT) -> frozenset[str]:
    """Every string constant of the product's code (docstrings included)."""
    return frozenset(
        n.value
        for tree in sources(packages).values()
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


# ---- metrics, rules, alerts


@cache
def metric_names() -> frozenset[str]:
    """The metric names the product registers: string constants that are a whole kvgate_ name
    (Counter, Histogram, the collectors' families and their name tables), plus the vLLM event
    path's families, named by f-string from gateway/vllm_worker.py's COUNTERS."""
    names = {c for c in constants() if re.fullmatch(r"kvgate_[a-z0-9_]+", c)}
    tree = ast.parse((ROOT / "gateway/vllm_worker.py").read_text())
    (counters,) = [
        n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "COUNTERS"
    ]
    names |= {f"kvgate_gateway_vllm_event_{name}" for name, _, _ in ast.literal_eval(counters)}
    return frozenset(names)


def registered(name: str) -> bool:
    """`name` is a registered metric or one of its series (a counter's _total, a histogram's
    _bucket/_sum/_count); `name*` is a prefix of one."""
    if name.endswith("*"):
        return any(n.startswith(name[:-1]) for n in metric_names())
    base = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
    return name in metric_names() or base in metric_names()


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_metric_named_is_registered(doc):
    # a brace group followed by `_` is part of the name (`kvgate_gateway_{predicted,actual}_...`),
    # any other is a label set (`kvgate_gateway_retries_total{stage}`)
    found = re.findall(r"(?<![\w:])kvgate_(?:[a-z0-9_]+|\{[a-z0-9_,]+\}(?=_))+\*?", doc.read_text())
    cited = {e for m in found for e in expand(m)}
    cited = {c for c in cited if not c.endswith("_")}  # a family prefix in prose, e.g. `kvgate_worker_`
    missing = sorted(c for c in cited if not registered(c))
    assert not missing, f"{doc_id(doc)} names metrics the code does not register: {missing}"


def test_metric_names_are_read_from_the_code():
    assert {"kvgate_gateway_requests", "kvgate_worker_requests_running", "kvgate_gateway_vllm_event_gaps"} <= (
        metric_names()
    )
    assert registered("kvgate_gateway_requests_total") and not registered("kvgate_gateway_no_such_total")


@cache
def rules() -> tuple[set[str], set[str]]:
    text = (ROOT / "deploy/prometheus/rules.yml").read_text()
    return set(re.findall(r"record: (\S+)", text)), set(re.findall(r"alert: (\S+)", text))


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_recording_rule_and_alert_named_exists(doc):
    records, alerts = rules()
    text = doc.read_text()
    for name in set(re.findall(r"(?<![\w:])kvgate:[a-z_]+:[a-z_]*rate\d+m\b", text)):  # not Redis keys (kvgate:share)
        assert name in records, f"{doc_id(doc)}: no recording rule {name} in deploy/prometheus/rules.yml"
    for name in set(re.findall(r"\bKvgate[A-Z]\w+", text)):
        assert name in alerts, f"{doc_id(doc)}: no alert {name} in deploy/prometheus/rules.yml"


def test_every_rule_and_alert_is_in_the_readme():
    records, alerts = rules()
    text = (ROOT / "README.md").read_text()
    assert not sorted(n for n in records | alerts if n not in text), "README: Rules and alerts"


# ---- headers, environment variables


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_kvgate_header_named_is_sent_or_read(doc):
    code = " ".join(constants()).lower()
    for header in set(re.findall(r"\bx-(?:kvgate|slo)-[a-z0-9-]*[a-z0-9]", doc.read_text())):
        assert header in code, f"{doc_id(doc)}: no code sends or reads {header}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_kvgate_variable_named_is_read(doc):
    code = " ".join(constants(CODE)) + (ROOT / "Makefile").read_text()
    for var in set(re.findall(r"\bKVGATE_[A-Z0-9_]*[A-Z0-9]", doc.read_text())):
        assert var in code, f"{doc_id(doc)}: nothing reads ${var}"


# ---- endpoints


@cache
def routes() -> dict[str, set[str]]:
    """Path (parameters as `{}`) -> methods, of every starlette Route the gateway and the workers
    serve (policies' `Route` is a decision, not an endpoint)."""
    found: dict[str, set[str]] = {}
    for tree in sources(("gateway", "workers")).values():
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "Route"
                and n.args
                and isinstance(n.args[0], ast.Constant)
                and str(n.args[0].value).startswith("/")
            ):
                methods = {"GET"}
                for kw in n.keywords:
                    if kw.arg == "methods":
                        methods = set(ast.literal_eval(kw.value))
                found.setdefault(re.sub(r"\{[^}]*\}", "{}", n.args[0].value), set()).update(methods)
    return found


def called(path: str) -> bool:
    """`path` is an endpoint the gateway calls on another server (vLLM's /kv_event_sources)."""
    return any(c == path or c.startswith(path + "?") for c in constants())


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_endpoint_named_is_served_with_its_method(doc):
    assert "/v1/chat/completions" in routes() and "POST" in routes()["/kv/import"]
    for span in spans(doc):
        pattern = (
            r"(?:\b(GET|POST) )?(?<![\w/.:~-])(/(?:v1|kv|state|steps|health|metrics|tokenize|detokenize)\b[\w/{}.-]*)"
        )
        for method, path in re.findall(pattern, span):
            path = re.sub(r"\{[^}]*\}", "{}", path.rstrip("."))
            assert path in routes() or called(path), f"{doc_id(doc)}: nothing serves {path}"
            if method and path in routes():
                assert method in routes()[path], f"{doc_id(doc)}: {path} does not take {method}"


# ---- files, links, make targets


def exists(path: str) -> bool:
    """A repository path, or `path/module.attr` (the attribute is test_code_named_exists')."""
    if "*" in path:
        return any(ROOT.glob(path + ("" if path.endswith("*") else "*")))
    if (ROOT / path).exists():
        return True
    m = re.fullmatch(r"(.+)\.\w+", path)
    return bool(m) and (ROOT / (m.group(1) + ".py")).exists()


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_repository_path_named_exists(doc):
    top = "|".join(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
    text = re.sub(r"--(out|png) \S+", "", doc.read_text())  # what a command would write
    for m in set(re.findall(rf"(?<![\w/.~-])((?:{top})/[\w./{{}},*-]*[\w/}}*])", text)):
        for path in expand(m):
            assert exists(path.rstrip(".")), f"{doc_id(doc)} names {path}, which is not in the repository"


def anchor(heading: str) -> str:
    """GitHub's id of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_link_resolves(doc):
    text = prose(doc)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, fragment = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        assert where.exists(), f"{doc_id(doc)} links to {target}, which is not in the repository"
        if fragment and where.suffix == ".md":
            ids = {anchor(h) for h in re.findall(r"^#+ (.+)$", prose(where), re.M)}
            assert fragment in ids, f"{doc_id(doc)} links to #{fragment}, no heading of {where.name}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_make_target_named_exists(doc):
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    for span in spans(doc):
        for target in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", span):
            assert target in targets, f"{doc_id(doc)}: no make target {target}"


# ---- commands and the code they run


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_kvgate_commands_take_the_flags_shown(doc):
    """As tests/test_cli.py does for the README's one-line commands, in every document and over
    spans that wrap (`kvgate bridge --vllm\\n  http://...`)."""
    for span in spans(doc):
        span = span.replace("\\\n", " ").replace("\\|", "/")
        for m in re.finditer(r"kvgate (bench serve|[a-z]+)((?: +[^\s|;&#]+)*)", span):
            command = m.group(1)
            if command == "bench" or (command not in COMMANDS and command != "bench serve"):
                continue  # prose: "kvgate workers", "kvgate's"
            flags = {s for a in parser_of(command)._actions for s in a.option_strings}
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)):
                assert flag in flags, f"{doc_id(doc)}: kvgate {command} has no {flag}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_python_modules_shown_exist_and_take_the_flags_shown(doc):
    for span in spans(doc):
        span = span.replace("\\\n", " ").replace("\\|", "/")
        for m in re.finditer(r"python (?:-m ([\w.]+)|([\w/]+\.py))((?: +[^\s|;&#`]+)*)", span):
            if m.group(1) and m.group(1).startswith("vllm."):
                continue  # vLLM's server
            path = ROOT / (m.group(1).replace(".", "/") + ".py" if m.group(1) else m.group(2))
            assert path.exists(), f"{doc_id(doc)}: no {m.group(1) or m.group(2)}"
            source = path.read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(3)):
                assert f'"{flag}"' in source, f"{doc_id(doc)}: {path.relative_to(ROOT)} has no {flag}"


@cache
def definitions() -> tuple[dict[Path, set[str]], dict[str, set[str]]]:
    """Each module's top-level names, and each class's members (methods, fields), of the code."""
    modules: dict[Path, set[str]] = {}
    classes: dict[str, set[str]] = {}
    for path, tree in sources(CODE).items():
        names = modules.setdefault(path, set())
        for n in tree.body:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Assign):
                names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
            if isinstance(n, ast.ClassDef):
                members = classes.setdefault(n.name, set())
                for b in n.body:
                    if isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef):
                        members.add(b.name)
                    elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                        members.add(b.target.id)
                    elif isinstance(b, ast.Assign):
                        members |= {t.id for t in b.targets if isinstance(t, ast.Name)}
    return modules, classes


# first parts of dotted names that are not code: JSON fields, span attributes, loggers, vLLM
NOT_CODE = {"gen_ai", "kv_transfer", "usage", "stream_options", "vllm_xargs", "kvgate", "vllm", "client", "r", "e"}


def resolves(ref: str) -> bool:
    """`pkg.module`, `pkg.module.name`, `module.name` (a module's file name, wherever it is),
    `dir/module.name`, `Class.member` or `module.Class.member` names something of the code."""
    modules, classes = definitions()
    parts = ref.replace("/", ".").split(".")
    if parts[0][0].isupper():  # Class.member
        return parts[0] in classes and parts[1] in classes[parts[0]]
    for cut in range(len(parts), 0, -1):  # the longest module path that is a file or package
        tail = "/".join(parts[:cut])
        files = [p for p in modules if p.with_suffix("").as_posix().endswith("/" + tail)]
        if not files and (ROOT / tail).is_dir() and cut == len(parts):
            return True  # a package: `workers.kv`
        if files:
            rest = parts[cut:]
            for f in files:
                if not rest:
                    return True
                if rest[0] in modules[f] and (len(rest) == 1 or rest[1] in classes.get(rest[0], set())):
                    return True
            return False
    return False


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_code_named_exists(doc):
    refs = set()
    for span in re.findall(r"`([^`]+)`", prose(doc)):
        for ref in re.findall(r"(?<![\w./-])([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)+)(?![\w/(-])", span):
            if ref.split(".")[0].split("/")[0] in NOT_CODE or re.search(r"\.(py|md|json|png|ya?ml|sh|pem)$", ref):
                continue
            refs.add(ref)
    missing = sorted(r for r in refs if not resolves(r))
    assert not missing, f"{doc_id(doc)} names code that is not there: {missing}"


def test_code_names_are_resolved_against_the_code():
    assert resolves("gateway.worker_view.tier_rates") and resolves("worker_view.tier_rates")
    assert resolves("executors/batch.step_work") and resolves("Fleet.begin") and resolves("workers.kv")
    assert not resolves("fleet.tier_rates") and not resolves("Fleet.no_such") and not resolves("no_such.module")


# ---- the dashboard


def test_every_dashboard_panel_is_in_the_readme_table():
    """Each panel's title (before a colon or parenthesis) is in one row of the README's panel
    table, word for word in any order: rows may join panels ("TTFT / TPOT / end-to-end latency at
    the gateway")."""
    dashboard = json.loads((ROOT / "grafana/dashboards/kvgate.json").read_text())
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| panel | what it shows |") :].split("\n\n")[0]
    rows = [set(re.split(r"[\s,/:()]+", line.split("|")[1].lower())) for line in table.splitlines()[2:]]

    def titles(panels):
        for p in panels:
            yield p["title"]
            yield from titles(p.get("panels", []))

    for title in titles(dashboard["panels"]):
        words = set(re.split(r"[\s,/]+", re.split(r"[:(]", title)[0].strip().lower())) - {""}
        assert any(words <= row for row in rows), f"README's dashboard table has no row for the panel {title!r}"
