// Element types and reduction ops the engine understands, independent of XLA.
#ifndef HERRING_ENGINE_DTYPE_H_
#define HERRING_ENGINE_DTYPE_H_

#include <cstddef>
#include <cstdint>

namespace herring::engine {

// Values travel in wire headers: never renumber.
enum class DType : uint8_t {
  kInvalid = 0,
  kFloat32 = 1,
  kFloat64 = 2,
  kBFloat16 = 3,
  kFloat16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kInt8 = 7,
  kInt16 = 8,
  kUInt8 = 9,
  kUInt16 = 10,
  kUInt32 = 11,
  kUInt64 = 12,
};

// Complex numbers travel as pairs of their real type and bool as int32 (as
// lax.psum converts it); neither needs a type of its own.

enum class ReduceOp : uint8_t {
  kSum = 0,
  kMean = 1,
  kMax = 2,  // NaN wins, as in XLA's maximum
  kMin = 3,
};

// What a reduction gives each process (ReduceRequest).
enum class Collective : uint8_t {
  kAllReduce = 0,      // the whole reduced buffer
  kReduceScatter = 1,  // its own part of it
  kAllGather = 2,      // every process's part (each contributes its own; op unused)
};

inline size_t ElementSize(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kInt8: return 1;
    case DType::kInt16: return 2;
    case DType::kUInt8: return 1;
    case DType::kUInt16: return 2;
    case DType::kUInt32: return 4;
    case DType::kUInt64: return 8;
    default: return 0;
  }
}

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kUInt8: return "uint8";
    case DType::kUInt16: return "uint16";
    case DType::kUInt32: return "uint32";
    case DType::kUInt64: return "uint64";
    default: return "invalid";
  }
}

inline const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    default: return "invalid";
  }
}

inline const char* CollectiveName(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all-reduce";
    case Collective::kReduceScatter: return "reduce-scatter";
    case Collective::kAllGather: return "all-gather";
    default: return "invalid";
  }
}

inline bool IsValidDType(uint8_t v) { return v >= 1 && v <= 12; }
inline bool IsValidOp(uint8_t v) { return v <= 3; }

}  // namespace herring::engine

#endif  // HERRING_ENGINE_DTYPE_H_
