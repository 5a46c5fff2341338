// The toy Objective-C runtime: selectors, classes with method tables, NSObject's memory
// management, autorelease pools and the block runtime (see objc_toy.h).
#include "objc_toy.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

struct objc_class : objc_object {
  objc_class* superclass = nullptr;
  std::string name;
  std::unordered_map<SEL, void*> methods;
  id (*allocate)(Class) = nullptr;
};

namespace {

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<std::string, std::unique_ptr<char[]>>& selector_table() {
  static std::unordered_map<std::string, std::unique_ptr<char[]>> table;
  return table;
}

std::unordered_map<std::string, std::unique_ptr<objc_class>>& class_table() {
  static std::unordered_map<std::string, std::unique_ptr<objc_class>> table;
  return table;
}

void* find_imp(Class cls, SEL sel) {
  // A per-thread direct-mapped cache of (class, selector) -> method, like the per-class cache of Apple's
  // objc_msgSend, so host-cost runs (`lily bench --host-only`) measure Lily rather than this runtime's hash lookups.
  // Methods are added at load (load_images), before any message is sent, so an entry never goes stale.
  struct CacheEntry {
    Class cls;
    SEL sel;
    void* imp;
  };
  thread_local CacheEntry cache[1024] = {};
  const uintptr_t slot = (reinterpret_cast<uintptr_t>(cls) >> 4) ^ (reinterpret_cast<uintptr_t>(sel) >> 3);
  CacheEntry& entry = cache[slot & 1023];
  if (entry.cls == cls && entry.sel == sel) return entry.imp;
  for (Class c = cls; c != nullptr; c = c->superclass) {
    auto it = c->methods.find(sel);
    if (it != c->methods.end()) {
      entry = {cls, sel, it->second};
      return it->second;
    }
  }
  return nullptr;
}

// One entry per autoreleased object; a pool token is the stack depth at its push.
thread_local std::vector<id> autorelease_stack;
thread_local long open_pools = 0;

}  // namespace

extern "C" {

SEL sel_registerName(const char* name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& table = selector_table();
  auto it = table.find(name);
  if (it == table.end()) {
    size_t n = std::strlen(name) + 1;
    std::unique_ptr<char[]> copy(new char[n]);
    std::memcpy(copy.get(), name, n);
    it = table.emplace(name, std::move(copy)).first;
  }
  return reinterpret_cast<SEL>(it->second.get());
}

const char* sel_getName(SEL sel) { return reinterpret_cast<const char*>(sel); }

Class objc_getClass(const char* name) {
  static std::once_flag loaded;
  std::call_once(loaded, objc_toy::load_images);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = class_table().find(name);
  return it == class_table().end() ? nullptr : it->second.get();
}

void* objc_toy_lookup_imp(id self, SEL sel) {
  void* imp = find_imp(self->isa, sel);
  if (imp == nullptr) {
    // The trampoline has no unwind information, so report and stop like an uncaught
    // NSInvalidArgumentException would.
    std::fprintf(stderr, "objc_toy: -[%s %s]: unrecognized selector sent to instance %p\n",
                 self->isa->name.c_str(), sel_getName(sel), static_cast<void*>(self));
    std::abort();
  }
  return imp;
}

void* objc_autoreleasePoolPush(void) {
  ++open_pools;
  return reinterpret_cast<void*>(autorelease_stack.size() + 1);
}

void objc_autoreleasePoolPop(void* pool) {
  size_t depth = reinterpret_cast<size_t>(pool) - 1;
  while (autorelease_stack.size() > depth) {
    id object = autorelease_stack.back();
    autorelease_stack.pop_back();
    using Release = void (*)(id, SEL);
    static SEL release = sel_registerName("release");
    reinterpret_cast<Release>(objc_toy_lookup_imp(object, release))(object, release);
  }
  --open_pools;
}

}  // extern "C"

namespace objc_toy {

std::atomic<long>& live_objects_counter() {
  static std::atomic<long> counter{0};
  return counter;
}

long live_objects() { return live_objects_counter().load(); }

Class define_class(const char* name, Class superclass) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& table = class_table();
  auto it = table.find(name);
  if (it != table.end()) return it->second.get();
  // A class object answers class methods through its metaclass, kept under "+name".
  auto meta = std::make_unique<objc_class>();
  meta->name = std::string("+") + name;
  meta->superclass = superclass ? superclass->isa : nullptr;
  auto cls = std::make_unique<objc_class>();
  cls->name = name;
  cls->superclass = superclass;
  cls->isa = meta.get();
  cls->allocate = superclass ? superclass->allocate : nullptr;
  // As in Apple's runtime, the root metaclass inherits from the root class.
  if (superclass == nullptr) meta->superclass = cls.get();
  table.emplace(meta->name, std::move(meta));
  return table.emplace(name, std::move(cls)).first->second.get();
}

void add_method(Class cls, const char* selector, void* imp, bool class_method) {
  SEL sel = sel_registerName(selector);
  std::lock_guard<std::mutex> lock(registry_mutex());
  (class_method ? cls->isa : cls)->methods[sel] = imp;
}

bool responds_to(Class cls, SEL sel) { return find_imp(cls, sel) != nullptr; }

const char* class_name(Class cls) { return cls->name.c_str(); }

void set_allocator(Class cls, id (*allocate)(Class)) { cls->allocate = allocate; }

}  // namespace objc_toy

// NSObject: reference counting and autorelease, as the binding relies on them.
namespace {

using objc_toy::Object;

id nsobject_alloc(id self, SEL) {
  Class cls = reinterpret_cast<Class>(self);
  if (cls->allocate == nullptr) {
    std::fprintf(stderr, "objc_toy: +[%s alloc]: class has no allocator\n", cls->name.c_str());
    std::abort();
  }
  return cls->allocate(cls);
}

id nsobject_init(id self, SEL) { return self; }

id nsobject_retain(id self, SEL) {
  static_cast<Object*>(self)->retain_count.fetch_add(1);
  return self;
}

void nsobject_release(id self, SEL) {
  auto* object = static_cast<Object*>(self);
  long before = object->retain_count.fetch_sub(1);
  if (before <= 0) {
    std::fprintf(stderr, "objc_toy: over-release of a %s\n", self->isa->name.c_str());
    std::abort();
  }
  if (before == 1) {
    objc_toy::live_objects_counter().fetch_sub(1);
    object->destroy(object);
  }
}

id nsobject_autorelease(id self, SEL) {
  if (open_pools == 0) {
    // Apple logs this and leaks; a test must not pass with it.
    std::fprintf(stderr, "objc_toy: %s autoreleased with no pool in place\n",
                 self->isa->name.c_str());
    std::abort();
  }
  autorelease_stack.push_back(self);
  return self;
}

unsigned long nsobject_retain_count(id self, SEL) {
  return static_cast<unsigned long>(static_cast<Object*>(self)->retain_count.load());
}

BOOL nsobject_responds_to_selector(id self, SEL, SEL query) {
  return objc_toy::responds_to(self->isa, query);
}

id nsobject_alloc_with_default(Class cls) { return objc_toy::make_object<Object>(cls); }

}  // namespace

namespace objc_toy {

Class root_class() {
  static Class root = [] {
    Class cls = objc_toy::define_class("NSObject", nullptr);
    objc_toy::set_allocator(cls, nsobject_alloc_with_default);
    objc_toy::add_method(cls, "alloc", reinterpret_cast<void*>(nsobject_alloc), true);
    objc_toy::add_method(cls, "init", reinterpret_cast<void*>(nsobject_init));
    objc_toy::add_method(cls, "retain", reinterpret_cast<void*>(nsobject_retain));
    objc_toy::add_method(cls, "release", reinterpret_cast<void*>(nsobject_release));
    objc_toy::add_method(cls, "autorelease", reinterpret_cast<void*>(nsobject_autorelease));
    objc_toy::add_method(cls, "retainCount", reinterpret_cast<void*>(nsobject_retain_count));
    objc_toy::add_method(cls, "respondsToSelector:",
                         reinterpret_cast<void*>(nsobject_responds_to_selector));
    return cls;
  }();
  return root;
}

id retain(id object) { return nsobject_retain(object, nullptr); }
void release(id object) { nsobject_release(object, nullptr); }
id autorelease(id object) { return nsobject_autorelease(object, nullptr); }

}  // namespace objc_toy
