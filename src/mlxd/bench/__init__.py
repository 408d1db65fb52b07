"""``mlxd bench``: mlxd against a peer server on the same model, over HTTP only.

The load generator (load.py) speaks the OpenAI chat API to any server; servers.py starts
and stops the processes; runner.py interleaves the two sides' passes and sums them up. No
MLX here: the servers are other processes.
"""
