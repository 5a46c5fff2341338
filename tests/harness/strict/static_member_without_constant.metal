// rule: program-scope-constant
// fix: static constexpr int => static constant constexpr const int
// A static data member outside the constant address space: clang accepts it, Metal does not (MSL §4.2).
#include <metal_stdlib>
using namespace metal;

template <int N>
struct Tile {
  static constexpr int ROWS = N / 2;
};

[[kernel]] void tile_rows(device int* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  out[tid] = Tile<8>::ROWS;
}
