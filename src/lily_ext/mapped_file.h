// A checkpoint file mapped into memory once: the Metal runtime wraps the mapping as a buffer, the CUDA runtime
// streams it into device memory.
#pragma once

#include <cstddef>
#include <string>

namespace lily {

// A checkpoint file mapped once (private: the file is never written), page-aligned (16 KB, Apple silicon) and padded to whole pages, so that
// Metal can wrap all of it as one buffer without a copy.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  void* data() const { return data_; }
  size_t mapped_length() const { return mapped_length_; }  // whole pages
  size_t file_length() const { return file_length_; }

 private:
  void* reservation_ = nullptr;
  size_t reservation_length_ = 0;
  void* data_ = nullptr;
  size_t mapped_length_ = 0, file_length_ = 0;
};

}  // namespace lily
