"""Client-side tools shared by benchmarks/, our_experiments/ and the end-to-end tests:
starting a server, naming its URLs, summarising latencies."""
