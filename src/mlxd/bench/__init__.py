"""``mlxd bench``: mlxd against a peer on the same model: a server over HTTP, or the engine.

The load generator (load.py) speaks the OpenAI chat API to any server; servers.py starts
and stops the processes; runner.py interleaves the two sides' passes and sums them up. No
MLX in the benchmark's process: the servers are other processes, and so is the engine
alone (engine_alone.py, driven through engine_peer.py).
"""
