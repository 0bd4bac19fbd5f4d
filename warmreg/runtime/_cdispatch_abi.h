/* The CUDA driver ABI warmreg/runtime/_cdispatch.c uses (cuda.h, CUDA 12+), declared here so that no CUDA
 * headers are needed to build it. tests/test_cdispatch.py compiles this file next to Triton's own
 * cuda.h and checks every size, offset and constant against it. */
#ifndef WARMREG_CDISPATCH_ABI_H
#define WARMREG_CDISPATCH_ABI_H

typedef int wr_result;
typedef void *wr_function;
typedef void *wr_stream;
typedef void *wr_context;
typedef int wr_device;
typedef union {
  char pad[64];
  struct {
    unsigned int x, y, z;
  } clusterDim;
  int clusterSchedulingPolicyPreference;
  int programmaticStreamSerializationAllowed;
  int cooperative;
} wr_attr_value;
typedef struct {
  int id;
  char pad[8 - sizeof(int)];
  wr_attr_value value;
} wr_launch_attr;
typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  wr_stream hStream;
  wr_launch_attr *attrs;
  unsigned int numAttrs;
} wr_launch_config;

enum {
  WR_ATTR_COOPERATIVE = 2,
  WR_ATTR_CLUSTER_DIMENSION = 4,
  WR_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE = 5,
  WR_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6,
  WR_CLUSTER_SCHEDULING_POLICY_SPREAD = 1,
  WR_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14,
  WR_ERROR_INVALID_CONTEXT = 201,
};

#endif
