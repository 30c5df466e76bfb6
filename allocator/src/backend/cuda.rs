//! The CUDA driver backend (feature `cuda`), filled in by the real-GPU work.
