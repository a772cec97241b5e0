# evtrain on CPU: the image every evtrain service of docker-compose.yml runs
# (bus, trainer, hooks). ENTRYPOINT is the `evtrain` CLI, so a service's
# `command:` is an evtrain subcommand line, e.g. ["hook", "logging", "--bus", ...].
#
#   docker build -t evtrain .
#   docker run --rm evtrain launch /app/examples/demo.py
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU-only torch first, from PyTorch's CPU index: the default wheel would pull
# several GB of CUDA libraries. Its own layer, so code changes do not redo it.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
# The distribution: pyproject.toml maps these folders into the evtrain package
# (bus/ -> evtrain.bus, ...); examples/ holds the job specs the services run.
COPY pyproject.toml README.md ./
COPY evtrain/ evtrain/
COPY bus/ bus/
COPY stages/ stages/
COPY hooks/ hooks/
COPY exporters/ exporters/
COPY examples/ examples/
# The demo extra brings scikit-learn (the bundled digits data) and matplotlib
# (`evtrain timeline --png`); torch is already satisfied.
RUN pip install '.[demo]'

# Runs (checkpoints, metrics.jsonl, events.jsonl) go to /runs, a volume shared
# by the trainer and the hooks that write files. A fresh named volume takes
# this directory's owner, so the unprivileged user can write there.
RUN useradd --create-home --uid 1000 evtrain && mkdir /runs && chown evtrain /runs
USER evtrain

ENTRYPOINT ["evtrain"]
CMD ["--help"]
