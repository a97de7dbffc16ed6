import torch

# The test machines share two cores: torch's default thread pool makes tiny models 30x slower
# under contention, and these tests are all tiny models.
torch.set_num_threads(1)
