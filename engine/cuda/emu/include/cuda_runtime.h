// Emulation stand-in for the CUDA runtime header: on the include path of the gpu-emu targets
// only (engine/cuda/CMakeLists.txt), so that host code and tests written against CUDA build
// with g++ and no toolkit. See engine/cuda/emu/cuda_emu.h.
#pragma once

#include "engine/cuda/emu/cuda_emu.h"
