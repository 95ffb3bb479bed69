"""The run report: report.html, one self-contained page of what a run did, or several runs on one comparison page.

    write.py   reads a run directory, plans the charts and lays the page out (`posttrain report`, write_report)
    charts.py  one matplotlib figure per chart, smoothed like TensorBoard, as a base64 PNG
    html.py    the page's HTML sections: headline, constant metrics, samples, config differences, run facts
    files.py   reading a run's files (metrics.jsonl, config.yaml, summary.json) and where the page goes
"""

from posttrain.report.write import add_report, load_run, load_runs, run_report, write_report

__all__ = ["add_report", "load_run", "load_runs", "run_report", "write_report"]
