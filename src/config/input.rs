//! Reading input files safely (`docs/config.md#limits`): only regular files (a FIFO would block
//! forever, a device never ends), and never more than a documented number of bytes, so that a
//! huge file or `/dev/zero` is refused instead of filling memory.

use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The largest config layer file read, in bytes (1 MiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The largest model manifest read, in bytes (4 MiB: room for thousands of nodes).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

/// Why an input file was not read. Displays as a reason, after the file's name.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// It does not exist or cannot be opened or read.
    #[error("cannot be read: {0}")]
    Io(#[from] std::io::Error),
    /// A FIFO, device, socket or directory.
    #[error("is not a regular file (it is a {0}); inputs must be regular files")]
    NotRegular(&'static str),
    /// Larger than the limit.
    #[error("is larger than the limit of {limit} bytes (docs/config.md#limits)")]
    TooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// Not UTF-8 text.
    #[error("is not UTF-8 text (invalid byte at offset {0})")]
    NotUtf8(usize),
}

/// What kind of file `meta` describes, for the refusal of one that is not regular.
fn kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "device";
        }
        if t.is_socket() {
            return "socket";
        }
    }
    "special file"
}

/// Opens `path` for reading if it is a regular file (following symlinks). The type is checked
/// before opening, since opening a FIFO blocks until a writer comes, and again on the open file
/// in case it was swapped in between.
///
/// # Errors
/// A missing or unreadable file, or one that is not regular.
pub fn open_regular(path: &Path) -> Result<File, InputError> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(InputError::NotRegular(kind(&meta)));
    }
    let file = File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(InputError::NotRegular(kind(&meta)));
    }
    Ok(file)
}

/// Reads the regular file at `path` as UTF-8 text of at most `limit` bytes.
///
/// # Errors
/// As [`open_regular`], a file longer than `limit`, or one that is not UTF-8.
pub fn read_text(path: &Path, limit: u64) -> Result<String, InputError> {
    let file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(InputError::TooLarge { limit });
    }
    String::from_utf8(bytes).map_err(|e| InputError::NotUtf8(e.utf8_error().valid_up_to()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_within_the_limit_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        std::fs::write(&p, "x = 1\n").unwrap();
        assert_eq!(read_text(&p, 6).unwrap(), "x = 1\n");
        assert!(matches!(
            read_text(&p, 5),
            Err(InputError::TooLarge { limit: 5 })
        ));
        std::fs::write(&p, b"ok\xff").unwrap();
        assert_eq!(
            read_text(&p, 100).unwrap_err().to_string(),
            "is not UTF-8 text (invalid byte at offset 2)"
        );
    }

    #[test]
    fn directories_and_devices_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            read_text(dir.path(), 100).unwrap_err().to_string(),
            "is not a regular file (it is a directory); inputs must be regular files"
        );
        #[cfg(unix)]
        assert!(matches!(
            read_text(Path::new("/dev/zero"), 100),
            Err(InputError::NotRegular("device"))
        ));
    }
}
