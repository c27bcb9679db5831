// Memory for a call's per-unit arrays (unit parts, plans, coefficients), kept by each thread for its next
// call. glibc hands large freed blocks back to the system (munmap, or a trim of the heap's top), so a call
// that allocates them afresh faults every page in again: on the 2-vCPU AMD guest of docs/bench a page
// fault took 17 us, and adaptive_clip on 4096 units faulted about 175 times a call, as long as the whole
// call's memory traffic. A kept block is reused instead; nothing else changes (the same arrays, the same
// values).
#pragma once

#include <gradclip/detail/config.hpp>

#include <cstddef>
#include <cstring>
#include <new>
#include <vector>

namespace gradclip {
inline namespace GRADCLIP_ABI {
namespace detail {

/// A thread's kept blocks: up to `slots` freed blocks of at least `kept_from` bytes, reused best-fit by
/// the thread's next requests; smaller blocks, which malloc keeps in its own free lists, go straight back.
/// Each block starts with a header holding its usable size, so a block reused for a smaller request is
/// kept again at its real size.
class scratch_blocks {
 public:
  static constexpr std::size_t kept_from = std::size_t(64) << 10;
  static constexpr std::size_t slots = 8;
  static constexpr std::size_t header = alignof(std::max_align_t);

  scratch_blocks() = default;
  scratch_blocks(const scratch_blocks&) = delete;
  scratch_blocks& operator=(const scratch_blocks&) = delete;
  ~scratch_blocks() {
    for (char* block : kept_)
      if (block) ::operator delete(block);
  }

  /// Usable memory of at least `bytes`: the smallest kept block that holds them, else a new one.
  void* take(std::size_t bytes) {
    std::size_t best = slots;
    for (std::size_t k = 0; k < slots; ++k)
      if (kept_[k] && size_of(kept_[k]) >= bytes && (best == slots || size_of(kept_[k]) < size_of(kept_[best])))
        best = k;
    if (best == slots) return new_block(bytes);
    char* block = kept_[best];
    kept_[best] = nullptr;
    return block + header;
  }

  /// Takes back memory from take, this thread's or another's: kept when it is large, in an empty slot or
  /// in place of the smallest kept block, if that one is smaller.
  void give(void* memory) noexcept {
    char* block = static_cast<char*>(memory) - header;
    if (size_of(block) < kept_from) return ::operator delete(block);
    std::size_t slot = 0;
    for (std::size_t k = 0; k < slots; ++k) {
      if (!kept_[k]) {
        slot = k;
        break;
      }
      if (size_of(kept_[k]) < size_of(kept_[slot])) slot = k;
    }
    if (kept_[slot] && size_of(kept_[slot]) >= size_of(block)) return ::operator delete(block);
    if (kept_[slot]) ::operator delete(kept_[slot]);
    kept_[slot] = block;
  }

  /// The usable bytes of the blocks kept now.
  std::size_t kept_bytes() const noexcept {
    std::size_t bytes = 0;
    for (const char* block : kept_)
      if (block) bytes += size_of(block);
    return bytes;
  }

  /// A block of `bytes` usable bytes outside any thread's keeping, and its release.
  static void* new_block(std::size_t bytes) {
    char* block = static_cast<char*>(::operator new(header + bytes));
    std::memcpy(block, &bytes, sizeof bytes);
    return block + header;
  }
  static void delete_block(void* memory) noexcept { ::operator delete(static_cast<char*>(memory) - header); }

 private:
  static std::size_t size_of(const char* block) noexcept {
    std::size_t bytes;
    std::memcpy(&bytes, block, sizeof bytes);
    return bytes;
  }

  char* kept_[slots] = {};
};

/// The calling thread's blocks, or null once its thread_locals are being destroyed (a plain bool, which
/// outlives them, says so).
inline scratch_blocks* this_threads_blocks() noexcept {
  thread_local bool closed = false;
  struct owner {
    scratch_blocks blocks;
    bool& closed;
    ~owner() { closed = true; }  // before the blocks are freed: later requests and releases bypass them
  };
  if (closed) return nullptr;
  thread_local owner mine{{}, closed};
  return &mine.blocks;
}

/// std::allocator's interface over the calling thread's scratch_blocks.
template <class T>
struct scratch_allocator {
  static_assert(alignof(T) <= scratch_blocks::header, "Scratch blocks align to max_align_t.");
  using value_type = T;

  scratch_allocator() noexcept = default;
  template <class U>
  scratch_allocator(const scratch_allocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    if (n > (std::size_t(-1) - scratch_blocks::header) / sizeof(T)) throw std::bad_array_new_length();
    scratch_blocks* blocks = this_threads_blocks();
    return static_cast<T*>(blocks ? blocks->take(n * sizeof(T)) : scratch_blocks::new_block(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t) noexcept {
    if (scratch_blocks* blocks = this_threads_blocks()) return blocks->give(p);
    scratch_blocks::delete_block(p);
  }

  template <class U>
  bool operator==(const scratch_allocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const scratch_allocator<U>&) const noexcept {
    return false;
  }
};

/// A call's per-unit array, its memory reused from call to call (scratch_blocks).
template <class T>
using scratch_vector = std::vector<T, scratch_allocator<T>>;

}  // namespace detail
}  // namespace GRADCLIP_ABI
}  // namespace gradclip
