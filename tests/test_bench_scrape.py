"""What the vLLM benchmarks read from a server's /metrics (`kvconnect.bench.vllm_pd.scrape_sums`): a histogram's
sum and count over its label sets, and a counter's share for one label value (which thread posted the pulls:
`vllm:kvconnect_pulls_posted_on{thread}`), from what prometheus_client really exposes (counters end in _total).
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvconnect.bench.gpu_pd import CELL_SERIES
from kvconnect.bench.vllm_pd import scrape_sums


@pytest.fixture
def metrics_url() -> Iterator[str]:
    registry = CollectorRegistry()
    posted = Counter("vllm:kvconnect_pulls_posted_on", "d", ["engine", "thread"], registry=registry)
    posted.labels("0", "loop").inc(3)
    posted.labels("0", "engine").inc(9)
    post = Histogram("vllm:kvconnect_post_time_seconds", "d", ["engine"], registry=registry)
    for engine, value in (("0", 0.25), ("1", 0.5)):
        post.labels(engine).observe(value)
    body = generate_latest(registry)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_a_histogram_is_summed_over_its_label_sets_and_a_counter_gives_one_labels_share(metrics_url: str) -> None:
    names = {k: CELL_SERIES["kvconnect"][k] for k in ("post_s", "loop_share")}
    got = scrape_sums(metrics_url, {**names, "absent_s": "vllm:kvconnect_no_such_seconds"})
    assert got == {"post_s": (0.75, 2.0), "loop_share": (3.0, 12.0), "absent_s": (0.0, 0.0)}
