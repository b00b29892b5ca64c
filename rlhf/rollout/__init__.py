"""Rollout generation: vLLM engines as Ray actors, and weight synchronisation from the policy into them."""
