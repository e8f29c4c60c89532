"""Benchmark harness: the seed's measurement method against `moestream serve` or llama-server
(prompts, per-request timings and disk reads, baseline text diff, time/token fit, report, plots),
the machine helpers it needs (cgroup memory limit, page cache, readahead, block-device counters),
and perplexity in llama.cpp's chunked convention."""
