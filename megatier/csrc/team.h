// Host-side control of the calling thread's OpenMP team (team.cpp); C++ only, not for CUDA units.
#pragma once

#include <torch/extension.h>

namespace megatier {

// Runs fn on the calling thread inside a parallel region whose other threads sleep until it returns.
pybind11::object run_with_team_parked(const pybind11::function& fn);

}  // namespace megatier
