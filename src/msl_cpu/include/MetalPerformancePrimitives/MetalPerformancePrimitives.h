#include "../msl_cpu_tensor_ops.h"  // MSL CPU harness: matmul2d, emulated for the qmm_nax kernels
