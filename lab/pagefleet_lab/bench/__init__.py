"""The lab's benchmarks: router and autoscale scenarios on a real fleet, soak, paired runs
with vLLM, the router's decision cost, the engine core's message, prefix caching, sharing,
KV waste, the GPU check and vLLM parity. Each writes a markdown table and a PNG plot."""
