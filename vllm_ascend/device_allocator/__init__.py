"""Sleep mode's device memory: tagged allocations that can be released and restored at the
same addresses (vmm.py), and vLLM's sleep-mode backend on them (sleep.py)."""
