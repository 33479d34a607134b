"""Support shared by the tests, the demo and the benchmark: a prefill worker in a process, a local cluster
of worker processes, free ports and polling with deadlines."""
