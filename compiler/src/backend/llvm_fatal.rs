//! LLVM's fatal errors end the process from inside LLVM; m3c cleans up first.

/// LLVM's fatal errors (an invalid target option, say) end the process
/// from inside LLVM; this handler removes the temporary folders first and
/// says what happened.
pub fn install_llvm_fatal_handler() {
    extern "C" fn on_fatal(reason: *const std::os::raw::c_char) {
        let msg = if reason.is_null() {
            String::from("unknown")
        } else {
            // SAFETY: LLVM passes a NUL-terminated message that lives for the call.
            unsafe { std::ffi::CStr::from_ptr(reason) }.to_string_lossy().into_owned()
        };
        m3c_signals::remove_temps();
        eprintln!("error: LLVM failed: {msg}");
        // SAFETY: as in `m3c_signals::install`: no destructors while LLVM is
        // mid-failure.
        unsafe { libc::_exit(1) };
    }
    // SAFETY: installs a plain C callback that never returns into LLVM.
    unsafe { inkwell::support::error_handling::install_fatal_error_handler(on_fatal) };
}
