//! End-to-end tests of m3c. One binary on purpose: every test binary that
//! links the compiler is large, so areas are modules here.

mod agents;
mod blocks;
mod cli;
mod compile;
mod config;
mod cuda;
mod data_parallel;
mod eagle3;
mod encoder;
mod gpu_kernels;
mod graph;
mod healing;
mod host_kernels;
mod hostile;
mod kv;
mod multihost;
mod netns;
mod parsers;
mod pipeline;
mod plan;
mod readme;
mod rocm;
mod routers;
mod serve;
mod shared;
mod speculative;
mod text;
mod tidy;
mod tiny;
mod trace;
mod video;
mod vision;
mod weights;
