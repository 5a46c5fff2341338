// A checkpoint file mapped into memory once: the Metal runtime wraps the mapping as a buffer, the CUDA runtime
// streams it into device memory.
#pragma once

#include <cstddef>
#include <functional>
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
  // Bytes to shift the file by so that its safetensors data section (after the 8-byte header length and the header)
  // starts on a 16-byte boundary; 0 for a file too short to be one. Writers such as MLX's leave the header at any
  // length, and a GPU reads uint32 codes or bf16 scales only at addresses aligned to them.
  size_t aligning_shift() const;
  // Hands the file to `copy` in consecutive pieces of at most `chunk` bytes (offset, bytes, length) and releases
  // each piece's pages once copied (the page cache keeps them): a load that copies the file holds one chunk of it.
  void copy_out(size_t chunk, const std::function<void(size_t, const unsigned char*, size_t)>& copy) const;

 private:
  void* reservation_ = nullptr;
  size_t reservation_length_ = 0;
  void* data_ = nullptr;
  size_t mapped_length_ = 0, file_length_ = 0;
};

}  // namespace lily
