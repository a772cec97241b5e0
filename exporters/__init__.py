"""Exporters: hooks that turn events into an outside format.

Prometheus ``/metrics`` (`PrometheusExporter`), the JSON-lines metrics log
(`MetricsLog`), TensorBoard scalars (`TensorBoardWriter`, optional extra) and
the event recorder (`EventRecorder`) that ``evtrain replay`` reads back.
"""

from evtrain.exporters.metrics_log import MetricsLog
from evtrain.exporters.prometheus import PrometheusExporter
from evtrain.exporters.recorder import EventRecorder
from evtrain.exporters.tensorboard import TensorBoardWriter

__all__ = ["EventRecorder", "MetricsLog", "PrometheusExporter", "TensorBoardWriter"]
