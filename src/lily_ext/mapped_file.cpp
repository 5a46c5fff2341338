// Mapped checkpoint files (see mapped_file.h).
#include "mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "types.h"

namespace lily {

namespace {

// Apple silicon's page size: newBufferWithBytesNoCopy wants the pointer and the length aligned to it.
constexpr size_t kMetalPage = 16384;

size_t round_up(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

MappedFile::MappedFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw Error("[engine] cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    throw Error("[engine] " + path + " is empty or cannot be read");
  }
  file_length_ = static_cast<size_t>(st.st_size);
  mapped_length_ = round_up(file_length_, kMetalPage);
  // Reserve one extra page so the file can be placed at a 16 KB boundary; the reservation's zero pages pad the
  // mapping to whole pages.
  reservation_length_ = mapped_length_ + kMetalPage;
  reservation_ = ::mmap(nullptr, reservation_length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0);
  if (reservation_ == MAP_FAILED) {
    ::close(fd);
    reservation_ = nullptr;
    throw Error("[engine] cannot reserve " + std::to_string(reservation_length_) + " bytes to map " + path);
  }
  void* aligned = reinterpret_cast<void*>(round_up(reinterpret_cast<uintptr_t>(reservation_), kMetalPage));
  // Private and writable: nothing the engine does writes to weights, but a write (the Linux test runtime copies
  // every bound range back after a dispatch) must land in a private copy, never in the file.
  void* mapped = ::mmap(aligned, file_length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0);
  ::close(fd);
  if (mapped == MAP_FAILED) {
    ::munmap(reservation_, reservation_length_);
    reservation_ = nullptr;
    throw Error("[engine] cannot map " + path + ": " + std::strerror(errno));
  }
  data_ = mapped;
}

size_t MappedFile::aligning_shift() const {
  uint64_t header = 0;
  if (file_length_ < sizeof header) return 0;
  std::memcpy(&header, data_, sizeof header);  // little-endian, as safetensors and every host Lily runs on
  if (header > file_length_ - sizeof header) return 0;
  const size_t data_start = sizeof header + header;
  return round_up(data_start, 16) - data_start;
}

void MappedFile::copy_out(size_t chunk, const std::function<void(size_t, const unsigned char*, size_t)>& copy) const {
  auto* bytes = static_cast<unsigned char*>(data_);
  for (size_t offset = 0; offset < file_length_; offset += chunk) {
    const size_t n = std::min(chunk, file_length_ - offset);
    copy(offset, bytes + offset, n);
    ::madvise(bytes + offset, n, MADV_DONTNEED);
  }
}

MappedFile::~MappedFile() {
  if (reservation_) ::munmap(reservation_, reservation_length_);
}

}  // namespace lily
