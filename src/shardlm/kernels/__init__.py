"""Kernels: the attention implementations the models call, each with the residuals its backward pass keeps named
for the remat policies. Below `models`; knows nothing of meshes or configs."""
