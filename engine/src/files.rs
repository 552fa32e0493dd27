//! The files the engine reads and writes, under the component's input and output rules
//! (the component's `docs/config.md#limits` and `#outputs`): inputs are regular files of a
//! bounded size, checked before they are opened (a FIFO would block, a device never ends);
//! an output must be a regular file if it exists, and never one of the inputs.

use std::path::Path;

/// Checks an input file named by `flag`: a regular file (links followed) of at most
/// `max_bytes`. Answers its size.
///
/// # Errors
/// It does not exist, is not a regular file, or is larger than `max_bytes`.
pub fn check_input(path: &Path, flag: &str, max_bytes: u64) -> Result<u64, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{flag} {shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!(
            "{flag} {shown}: not a regular file (a FIFO, a device, a socket or a directory is refused)"
        ));
    }
    if meta.len() > max_bytes {
        return Err(format!(
            "{flag} {shown}: {} bytes, more than the {max_bytes} bytes allowed",
            meta.len()
        ));
    }
    Ok(meta.len())
}

/// Checks an output file named by `flag`: if it exists it must be a regular file, and it must
/// not be any of `inputs` (`(flag, path)`), compared as files (device and inode, through
/// links), so writing it cannot overwrite what the engine reads.
///
/// # Errors
/// The output exists and is not a regular file, or is one of the inputs.
pub fn check_output(path: &Path, flag: &str, inputs: &[(&str, &Path)]) -> Result<(), String> {
    let shown = path.display();
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err(format!(
                "{flag} {shown}: not a regular file (a FIFO, a device, a socket or a directory is refused)"
            ));
        }
    }
    for (input_flag, input) in inputs {
        if same_file::is_same_file(path, input).unwrap_or(false) {
            return Err(format!(
                "{flag} {shown}: is the {input_flag} file {}; it would be overwritten",
                input.display()
            ));
        }
    }
    Ok(())
}
