// A toy Objective-C runtime for Linux x86-64, used only by the tests of the Metal binding.
//
// It exports the same C entry points the binding takes from Apple's libobjc (objc_msgSend,
// sel_registerName, objc_getClass, objc_autoreleasePoolPush/Pop) and the block runtime
// (_Block_copy, _Block_release, _NSConcreteStackBlock), so src/lily_ext/metal/ compiles and
// links unchanged on both systems. Classes are defined from C++ (namespace objc_toy) by the
// fake Metal; every object starts with its isa pointer, as in the real runtime.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

extern "C" {
struct objc_class;
struct objc_selector;
struct objc_object {
  objc_class* isa;
};
using id = objc_object*;
using Class = objc_class*;
using SEL = const objc_selector*;
using BOOL = bool;

// Declared without a prototype as on Apple (OBJC_OLD_DISPATCH_PROTOTYPES=0): callers must
// cast it to the exact function type of the method they call.
void objc_msgSend(void);
SEL sel_registerName(const char* name);
const char* sel_getName(SEL sel);
Class objc_getClass(const char* name);
void* objc_autoreleasePoolPush(void);
void objc_autoreleasePoolPop(void* pool);

extern void* _NSConcreteStackBlock[32];
extern void* _NSConcreteMallocBlock[32];
extern void* _NSConcreteGlobalBlock[32];
void* _Block_copy(const void* block);
void _Block_release(const void* block);

// The IMP lookup the objc_msgSend trampoline calls; aborts on an unknown selector, as an
// uncaught NSInvalidArgumentException would.
void* objc_toy_lookup_imp(id self, SEL sel);
}

namespace objc_toy {

// The common head of every toy object. Subclasses add C++ members after it (no virtual
// functions: the isa pointer must stay at offset 0).
struct Object : objc_object {
  std::atomic<long> retain_count{1};
  void (*destroy)(Object*) = nullptr;
};

// NSObject, the root class (retain/release/autorelease/alloc/init/respondsToSelector:).
Class root_class();
// Defines the classes of the "loaded images" (the fake Metal); objc_getClass calls it once.
void load_images();

// Creates (once) a class named `name` under `superclass` (nullptr for a root class).
Class define_class(const char* name, Class superclass);
// Adds an instance method (or, with class_method, a method of the class object).
void add_method(Class cls, const char* selector, void* imp, bool class_method = false);
// Whether instances of cls answer sel (walks the superclasses).
bool responds_to(Class cls, SEL sel);
const char* class_name(Class cls);

// Number of toy objects alive now: lets tests check that the binding releases what it owns.
std::atomic<long>& live_objects_counter();
long live_objects();

// Allocates a T (derived from Object) with retain count 1 and isa = cls.
template <class T>
T* make_object(Class cls) {
  T* object = new T();
  object->isa = cls;
  object->destroy = [](Object* o) { delete static_cast<T*>(o); };
  live_objects_counter().fetch_add(1);
  return object;
}

// NSObject's retain, release and autorelease, callable from the fake classes' C++ code.
id retain(id object);
void release(id object);
id autorelease(id object);

// Sets what `+alloc` creates for cls (and its subclasses unless they set their own).
void set_allocator(Class cls, id (*allocate)(Class cls));

}  // namespace objc_toy
