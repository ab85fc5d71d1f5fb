//! Memory aligned for `O_DIRECT`: the header block, and a bounce buffer for a payload whose
//! address or length is not aligned.

use std::alloc::{alloc_zeroed, dealloc, Layout};

/// `O_DIRECT` wants buffers, offsets and lengths in multiples of the logical block size; a page
/// covers every block size in use (512 B and 4 KiB).
pub const ALIGN: usize = 4096;

pub fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

pub fn is_aligned(buf: &[u8]) -> bool {
    (buf.as_ptr() as usize) % ALIGN == 0 && buf.len() % ALIGN == 0
}

/// A zeroed buffer of `len` bytes (a multiple of [`ALIGN`]) at an aligned address.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// The buffer is owned memory, used by one thread at a time.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let len = round_up(len.max(1));
        let layout = Layout::from_size_align(len, ALIGN).expect("a valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialized (zeroed) bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).expect("a valid layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, layout) }
    }
}
