"""The pod's /metrics, scraped and parsed by the Prometheus client library's own parser: for the metrics tests
(tests/views/test_metrics.py) and every other test that reads a pod's figures there."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, key: str = "") -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from a real scrape; raises HTTPError on 401."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def try_scrape(port: int, key: str = ""):
    try:
        return scrape(port, key)
    except OSError:
        return None
