"""A worker script as torchrun runs it: it makes its own default group, uses it and ends it
(tests/foundation/test_worlds.py runs it as a job right after a job that used the world's group)."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(t)
print(f"sum {int(t.item())} over {dist.get_world_size()} ranks", flush=True)
dist.destroy_process_group()
