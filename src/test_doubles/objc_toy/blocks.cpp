// The block runtime entry points Metal uses on a completion handler: _Block_copy moves a stack
// block to the heap (calling its copy helper), _Block_release drops a heap block (calling its
// dispose helper at zero). Layout and flags follow clang's Block ABI ("Block-ABI-Apple").
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "objc_toy.h"

extern "C" {
void* _NSConcreteStackBlock[32];
void* _NSConcreteMallocBlock[32];
void* _NSConcreteGlobalBlock[32];
}

namespace {

enum : int {
  kRefcountMask = 0xfffe,  // the count is kept in units of 2; bit 0 means "deallocating"
  kNeedsFree = 1 << 24,
  kHasCopyDispose = 1 << 25,
  kIsGlobal = 1 << 28,
};

struct BlockDescriptor {
  unsigned long reserved;
  unsigned long size;
  void (*copy)(void* dst, const void* src);  // present only with kHasCopyDispose
  void (*dispose)(const void* block);
};

struct BlockHeader {
  void* isa;
  std::atomic<int> flags;
  int reserved;
  void (*invoke)(void*, ...);
  BlockDescriptor* descriptor;
};

}  // namespace

extern "C" void* _Block_copy(const void* arg) {
  if (arg == nullptr) return nullptr;
  auto* block = static_cast<BlockHeader*>(const_cast<void*>(arg));
  int flags = block->flags.load();
  if (flags & kIsGlobal) return block;
  if (flags & kNeedsFree) {
    block->flags.fetch_add(2);
    return block;
  }
  auto* copy = static_cast<BlockHeader*>(std::malloc(block->descriptor->size));
  std::memcpy(static_cast<void*>(copy), block, block->descriptor->size);
  copy->isa = _NSConcreteMallocBlock;
  copy->flags.store((flags & ~(kRefcountMask | 1)) | kNeedsFree | 2);
  if (flags & kHasCopyDispose) block->descriptor->copy(copy, block);
  return copy;
}

extern "C" void _Block_release(const void* arg) {
  if (arg == nullptr) return;
  auto* block = static_cast<BlockHeader*>(const_cast<void*>(arg));
  int flags = block->flags.load();
  if (!(flags & kNeedsFree)) return;  // global and stack blocks are not reference counted
  if ((block->flags.fetch_sub(2) & kRefcountMask) == 2) {
    if (flags & kHasCopyDispose) block->descriptor->dispose(block);
    std::free(block);
  }
}
