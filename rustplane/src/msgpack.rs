//! A small MessagePack codec: decoding the segment's cache entries and series names, encoding run records
//! the way Python's `msgpack.Packer(use_bin_type=True)` does (smallest integer and string forms).

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::Int(i) => Some(i),
            Value::UInt(u) => i64::try_from(u).ok(),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::UInt(u) => Some(u),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(f) => Some(f),
            Value::Int(i) => Some(i as f64),
            Value::UInt(u) => Some(u as f64),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, Value::Nil)
    }

    /// The value of string key `k` in a map (None when not a map or absent).
    pub fn get(&self, k: &str) -> Option<&Value> {
        match self {
            Value::Map(m) => m.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v),
            _ => None,
        }
    }
}

pub fn decode(buf: &[u8]) -> Option<Value> {
    let mut pos = 0;
    let v = read(buf, &mut pos, 0)?;
    Some(v)
}

fn take<'a>(buf: &'a [u8], pos: &mut usize, n: usize) -> Option<&'a [u8]> {
    let end = pos.checked_add(n)?;
    let s = buf.get(*pos..end)?;
    *pos = end;
    Some(s)
}

fn be(buf: &[u8], pos: &mut usize, n: usize) -> Option<u64> {
    Some(take(buf, pos, n)?.iter().fold(0u64, |a, &b| a << 8 | b as u64))
}

fn read(buf: &[u8], pos: &mut usize, depth: u32) -> Option<Value> {
    if depth > 64 {
        return None;
    }
    let b = *buf.get(*pos)?;
    *pos += 1;
    let v = match b {
        0x00..=0x7f => Value::UInt(b as u64),
        0x80..=0x8f => read_map(buf, pos, (b & 0x0f) as usize, depth)?,
        0x90..=0x9f => read_array(buf, pos, (b & 0x0f) as usize, depth)?,
        0xa0..=0xbf => read_str(buf, pos, (b & 0x1f) as usize)?,
        0xc0 => Value::Nil,
        0xc2 => Value::Bool(false),
        0xc3 => Value::Bool(true),
        0xc4..=0xc6 => {
            let n = be(buf, pos, 1 << (b - 0xc4))? as usize;
            Value::Bin(take(buf, pos, n)?.to_vec())
        }
        0xca => Value::Float(f32::from_bits(be(buf, pos, 4)? as u32) as f64),
        0xcb => Value::Float(f64::from_bits(be(buf, pos, 8)?)),
        0xcc..=0xcf => Value::UInt(be(buf, pos, 1 << (b - 0xcc))?),
        0xd0 => Value::Int(be(buf, pos, 1)? as u8 as i8 as i64),
        0xd1 => Value::Int(be(buf, pos, 2)? as u16 as i16 as i64),
        0xd2 => Value::Int(be(buf, pos, 4)? as u32 as i32 as i64),
        0xd3 => Value::Int(be(buf, pos, 8)? as i64),
        0xd9..=0xdb => {
            let n = be(buf, pos, 1 << (b - 0xd9))? as usize;
            read_str(buf, pos, n)?
        }
        0xdc | 0xdd => {
            let n = be(buf, pos, 2 << (b - 0xdc))? as usize;
            read_array(buf, pos, n, depth)?
        }
        0xde | 0xdf => {
            let n = be(buf, pos, 2 << (b - 0xde))? as usize;
            read_map(buf, pos, n, depth)?
        }
        0xe0..=0xff => Value::Int(b as i8 as i64),
        _ => return None, // ext types: never in qag's entries
    };
    Some(v)
}

fn read_str(buf: &[u8], pos: &mut usize, n: usize) -> Option<Value> {
    Some(Value::Str(String::from_utf8(take(buf, pos, n)?.to_vec()).ok()?))
}

fn read_array(buf: &[u8], pos: &mut usize, n: usize, depth: u32) -> Option<Value> {
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        out.push(read(buf, pos, depth + 1)?);
    }
    Some(Value::Array(out))
}

fn read_map(buf: &[u8], pos: &mut usize, n: usize, depth: u32) -> Option<Value> {
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let k = read(buf, pos, depth + 1)?;
        let v = read(buf, pos, depth + 1)?;
        out.push((k, v));
    }
    Some(Value::Map(out))
}

/// An encoder producing the bytes Python's msgpack produces for the same values.
#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn array(&mut self, n: usize) {
        if n < 16 {
            self.0.push(0x90 | n as u8);
        } else if n < 0x10000 {
            self.0.push(0xdc);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xdd);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    pub fn nil(&mut self) {
        self.0.push(0xc0);
    }

    pub fn uint(&mut self, v: u64) {
        if v < 128 {
            self.0.push(v as u8);
        } else if v < 0x100 {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v < 0x10000 {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v < 0x1_0000_0000 {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn int(&mut self, v: i64) {
        if v >= 0 {
            return self.uint(v as u64);
        }
        if v >= -32 {
            self.0.push(v as i8 as u8);
        } else if v >= -128 {
            self.0.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= -32768 {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn str(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.0.push(0xa0 | n as u8);
        } else if n < 0x100 {
            self.0.extend_from_slice(&[0xd9, n as u8]);
        } else if n < 0x10000 {
            self.0.push(0xda);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xdb);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    pub fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    pub fn opt_int(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.int(v),
            None => self.nil(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_small_and_large() {
        let mut e = Enc::default();
        e.array(5);
        e.int(-1);
        e.uint(300);
        e.str("héllo");
        e.nil();
        e.int(-70000);
        let v = decode(&e.0).unwrap();
        assert_eq!(
            v,
            Value::Array(vec![Value::Int(-1), Value::UInt(300), Value::Str("héllo".into()), Value::Nil, Value::Int(-70000)])
        );
        // Python: msgpack.packb([-1, 300, "héllo", None, -70000], use_bin_type=True)
        assert_eq!(e.0, b"\x95\xff\xcd\x01\x2c\xa6h\xc3\xa9llo\xc0\xd2\xff\xfe\xee\x90".to_vec());
    }
}
