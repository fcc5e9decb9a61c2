"""Harnesses for tests, benchmarks and the demo: local and netns clusters, a
local etcd, an HTTP store. The daemon never imports them."""
