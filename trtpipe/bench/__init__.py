"""trtpipe bench: AIPerf-driven load, server-side truth, sweeps and plots, A/B compare, the deployment report."""
